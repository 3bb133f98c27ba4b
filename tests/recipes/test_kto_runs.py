"""recipes/kto.py as a user runs it: it learns on the embedded data, runs under 2-process ZeRO-3 with one class per
rank, resumes bit-identically after SIGKILL. (The loss by hand: tests/algos/test_preference.py; unpaired data and
packing: tests/data/test_datasets.py.)"""

import math

import pytest
import torch
from helpers import (
    assert_resume_bit_identical,
    launch_cmd,
    load_weights,
    metrics,
    recipe_cmd,
    run,
    write_jsonl,
)

from verl_kit.data import load_split
from verl_kit.models import TINY_PREFS
from verl_kit.train import step_indices


@pytest.mark.slow
def test_kto_learns_on_embedded_data(tmp_path, tiny_model_path):
    """The embedded paired task, unpaired by default: held-out implicit-reward classification >= 0.85, desirable
    log-ratios rise while undesirable ones fall, every parameter moves. (80 steps, ~15 s: at 40 the undesirable
    log-ratios have fallen by only 0.8 on average.)"""
    out = tmp_path / "run"
    p = run(recipe_cmd("kto.py", ["--output_dir", str(out), "--dataset_train_split", "train[:800]",
                                  "--dataset_test_split", "test[:100]", "--max_steps", "80",
                                  "--per_device_train_batch_size", "8", "--eval_steps", "1000",
                                  "--logging_steps", "5"]), timeout=240)
    rows = metrics(out)
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 80]
    assert evals[-1]["eval/rewards/accuracy"] >= 0.85, evals
    assert evals[-1]["eval/rewards/desirable"] > 0 > evals[-1]["eval/rewards/undesirable"], evals
    train = [r for r in rows if "loss" in r]
    assert all(math.isfinite(r["loss"]) and r["kl"] >= 0 for r in train)
    late = train[-4:]
    assert sum(r["logratio/desirable"] for r in late) / 4 > train[0]["logratio/desirable"] + 1.0
    assert sum(r["logratio/undesirable"] for r in late) / 4 < train[0]["logratio/undesirable"] - 1.0
    assert all(k in train[-1] for k in ("kl", "rewards/desirable", "rewards/undesirable", "perf/tokens_per_s"))
    assert "outside [1, 4/3]" not in p.stderr  # the unpaired embedded data is balanced
    before, after = load_weights(tiny_model_path), load_weights(out / "final")
    assert not [k for k in before if torch.equal(before[k], after[k])]


def _one_class_per_shard(tmp_path, n=24, per_step=6, seed=42):
    """Unpaired data built from the embedded pairs, labelled so that step 0 holds 3 desirable then 3 undesirable
    examples: in 1 process with micro-batches of 3 they are an all-desirable then an all-undesirable micro-batch, in
    2 processes each rank holds one class only. The rest alternate."""
    pairs = list(load_split(TINY_PREFS, f"train[:{n}]"))
    first = step_indices(n, 0, per_step, seed, 0, 1)
    label = {i: k < per_step // 2 for k, i in enumerate(first)}
    rows = []
    for i, r in enumerate(pairs):
        good = label.get(i, i % 2 == 0)
        rows.append({"prompt": r["prompt"], "completion": r["chosen" if good else "rejected"], "label": good})
    return write_jsonl(tmp_path / "unpaired.jsonl", rows)


def _args(data, out, *extra):
    return ["--dataset_name", data, "--dataset_test_split", "none", "--output_dir", str(out), "--max_steps", "4",
            "--logging_steps", "1", "--save_steps", "2", "--desirable_weight", "1.5", *extra]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """1 process, micro-batches of 3 (odd), 2 of them per step: the run the others are compared with."""
    tmp = tmp_path_factory.mktemp("kto_ref")
    data = _one_class_per_shard(tmp)
    out = tmp / "ref"
    p = run(recipe_cmd("kto.py", _args(data, out, "--per_device_train_batch_size", "3",
                                       "--gradient_accumulation_steps", "2")), timeout=240)
    return data, out, p


@pytest.mark.slow
def test_zero3_two_ranks_one_class_each_matches_one_process(reference_run, tmp_path):
    """2-process ZeRO-3, one example per rank per micro-step (batch of one), 3 micro-steps: each rank holds a single
    class at step 0. Loss and the KL reference point equal the 1-process run's at every step (the same 6 examples
    per step, reduced by global counts), nothing is NaN, nothing hangs, the balance warning appears once."""
    data, ref_out, ref_p = reference_run
    out = tmp_path / "z3"
    p = run(launch_cmd("zero3.yaml", 2, "kto.py", _args(data, out, "--per_device_train_batch_size", "1",
                                                         "--gradient_accumulation_steps", "3")), timeout=300)
    ref = [r for r in metrics(ref_out) if "loss" in r]
    z3 = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in z3] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(z3, ref):
        assert all(math.isfinite(v) for v in a.values() if isinstance(v, float)), a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), (a, b)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-5), (a, b)
        for k in ("rewards/desirable", "rewards/undesirable"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), (k, a, b)
        if a["step"] > 1:  # at step 1 policy == reference: r and z0 are rounding noise around 0
            assert a["rewards/accuracy"] == b["rewards/accuracy"], (a, b)
    assert p.stderr.count("outside [1, 4/3]") == 1 and ref_p.stderr.count("outside [1, 4/3]") == 1
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(reference_run, tmp_path):
    """Kill the run (SIGKILL) once checkpoint-2 is complete, resume with --resume_from_checkpoint auto: the final
    weights equal the uninterrupted run's (the reference run) bit for bit, and metrics.jsonl reads as one run with the
    same numbers at steps 3 and 4."""
    data, ref_out, _ = reference_run
    out = tmp_path / "killed"
    cmd = lambda o, *extra: recipe_cmd("kto.py", [*_args(data, o, "--per_device_train_batch_size", "3",
                                                         "--gradient_accumulation_steps", "2"), *extra])
    assert_resume_bit_identical(cmd, ref_out, out, 2, run_a=False, compare_steps=(3, 4), timeout=240)
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3, 4]
