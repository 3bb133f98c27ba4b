"""KTO: the loss and its reference point worked by hand, robust batches and reductions, packed == padded for the
target and the KL sequences, unpaired data and its errors, and recipes/kto.py as a user runs it (learns, runs under
2-process ZeRO-3 with one class per rank, resumes bit-identically after SIGKILL)."""

import json
import math

import pytest
import torch
from helpers import assert_resume_bit_identical, launch_cmd, load_weights, metrics, recipe_cmd, run

from verl_kit.algos import kl_reference_point, kto_loss
from verl_kit.data import forward_logits, layout, load_split, mismatched_partners, sequence_logprobs, unpaired_examples
from verl_kit.errors import UserError
from verl_kit.models import TINY_PREFS, load_causal_lm
from verl_kit.train import step_indices

LN3 = math.log(3)


# ---- maths -----------------------------------------------------------------------------------------------------------

def test_kto_loss_hand_worked():
    """beta = 0.5, z0 = 0.4, lambda_D = 2, lambda_U = 0.5, ref log-probs all -2, so r = policy + 2.

    ex 1 desirable,   r = 0.4:          sigma(0.5 (0.4 - 0.4)) = sigma(0) = 1/2         loss = 2 (1 - 1/2) = 1
    ex 2 desirable,   r = 0.4 + 2 ln 3: sigma(0.5 * 2 ln 3) = sigma(ln 3) = 3/4         loss = 2 (1 - 3/4) = 0.5
    ex 3 undesirable, r = 0.4 + 2 ln 3: sigma(0.5 (0.4 - r)) = sigma(-ln 3) = 1/4       loss = 0.5 (1 - 1/4) = 0.375
    ex 4 undesirable, r = 0.4 - 2 ln 3: sigma(ln 3) = 3/4                               loss = 0.5 (1 - 3/4) = 0.125

    Gradients w.r.t. the policy log-prob, with sigma' = sigma (1 - sigma):
    desirable   d/dr lambda_D (1 - sigma(beta (r - z0))) = -lambda_D beta sigma'   ex 1: -2 * 0.5 * 1/4 = -0.25
                                                                                  ex 2: -2 * 0.5 * 3/16 = -0.1875
    undesirable d/dr lambda_U (1 - sigma(beta (z0 - r))) = +lambda_U beta sigma'   ex 3: 0.5 * 0.5 * 3/16 = 0.046875
                                                                                  ex 4: 0.5 * 0.5 * 3/16 = 0.046875
    z0 is detached: no gradient reaches it."""
    r = torch.tensor([0.4, 0.4 + 2 * LN3, 0.4 + 2 * LN3, 0.4 - 2 * LN3], dtype=torch.float64)
    policy = (r - 2).requires_grad_()
    kl = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([True, True, False, False])
    losses = kto_loss(policy, torch.full((4,), -2.0, dtype=torch.float64), labels, kl, beta=0.5,
                      desirable_weight=2.0, undesirable_weight=0.5)
    torch.testing.assert_close(losses, torch.tensor([1.0, 0.5, 0.375, 0.125], dtype=torch.float64))
    losses.sum().backward()
    torch.testing.assert_close(policy.grad, torch.tensor([-0.25, -0.1875, 0.046875, 0.046875], dtype=torch.float64))
    assert kl.grad is None


def test_kto_loss_default_weights_and_symmetry():
    """beta = 1, z0 = 0, weights 1: a desirable r = ln 3 gives 1 - sigma(ln 3) = 1/4, an undesirable r = ln 3 gives
    1 - sigma(-ln 3) = 3/4; swapping the sign of r swaps them."""
    r = torch.tensor([LN3, LN3, -LN3, -LN3])
    losses = kto_loss(r, torch.zeros(4), torch.tensor([True, False, True, False]), torch.tensor(0.0), beta=1.0)
    torch.testing.assert_close(losses, torch.tensor([0.25, 0.75, 0.75, 0.25]))


def test_kl_reference_point_mean_clamp_and_detach():
    """Sum 3 over 4 pairs -> 0.75. Sum -3 over 4 -> mean -0.75, clamped to 0 (a KL is never negative; the sample
    estimate can be). No pairs -> 0, not 0/0. The result carries no gradient."""
    s = torch.tensor(3.0, requires_grad=True)
    z0 = kl_reference_point(s, torch.tensor(4))
    assert z0.item() == 0.75 and not z0.requires_grad
    assert kl_reference_point(torch.tensor(-3.0), torch.tensor(4)).item() == 0.0
    assert kl_reference_point(torch.tensor(0.0), torch.tensor(0)).item() == 0.0


def test_kto_robust_batches():
    """Batch of one, an empty shard, one class only: finite values, and the desirable-only / undesirable-only
    values are the same as inside a mixed batch (per-example loss, no per-batch normalisation)."""
    z0 = torch.tensor(0.2)
    for label in (True, False):
        one = kto_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([label]), z0, 0.1)
        assert one.shape == (1,) and torch.isfinite(one).all()
    empty = kto_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), z0, 0.1)
    assert empty.shape == (0,) and empty.sum().item() == 0.0
    pol, ref = torch.randn(5), torch.randn(5)
    y = torch.tensor([True, False, True, True, False])
    mixed = kto_loss(pol, ref, y, z0, 0.1)
    torch.testing.assert_close(kto_loss(pol[y], ref[y], y[y], z0, 0.1), mixed[y])
    torch.testing.assert_close(kto_loss(pol[~y], ref[~y], y[~y], z0, 0.1), mixed[~y])


def test_sharded_reduction_equals_whole_batch():
    """The recipe's reduction: z0 from KL sums and counts added over shards, then sum(losses) / N_global. Seven
    examples (odd) split 3 | 1 | 3 as desirable-only | undesirable-only | mixed shards give the same z0, loss and
    gradient as the whole batch: sum over shards of (shard sum / 7) = mean over 7."""
    g = torch.Generator().manual_seed(0)
    pol = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    ref, kl_pol, kl_ref = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    kl_pol = kl_pol + 1.0  # a positive KL estimate, so the clamp does not hide a wrong mean
    y = torch.tensor([True, True, True, False, True, False, True])
    z_whole = kl_reference_point((kl_pol - kl_ref).sum(), torch.tensor(7))
    whole = kto_loss(pol, ref, y, z_whole, 0.5, 1.3, 0.7).mean()
    (g_whole,) = torch.autograd.grad(whole, pol)

    shards = [[0, 1, 2], [3], [4, 5, 6]]
    assert all(y[s].all() for s in shards[:1]) and not y[shards[1]].any()
    kl_sum = sum((kl_pol[s] - kl_ref[s]).sum() for s in shards)
    z = kl_reference_point(kl_sum, torch.tensor(sum(len(s) for s in shards)))
    total = sum(kto_loss(pol[s], ref[s], y[s], z, 0.5, 1.3, 0.7).sum() / 7 for s in shards)
    (g_sharded,) = torch.autograd.grad(total, pol)
    torch.testing.assert_close(z, z_whole)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_sharded, g_whole)


# ---- packing ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_model_path):
    torch.manual_seed(0)
    m = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    with torch.no_grad():  # move away from init so logits are not nearly uniform
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def test_packed_kto_target_and_kl_equal_padded(model):
    """Target sequences (x_i, y_i) and KL sequences (x_i, y_j(i)), packed vs padded: the KL log-ratio sum, the loss
    and every gradient agree in fp32 (atol 1e-5)."""
    g = torch.Generator().manual_seed(1)
    rand = lambda lo, hi: torch.randint(5, 600, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
    prompts, comps = [rand(2, 12) for _ in range(7)], [rand(1, 15) for _ in range(7)]
    partner = mismatched_partners(prompts, seed=0)
    labels = torch.tensor([True, False, False, True, True, False, True])
    ref, ref_kl = torch.randn(7) - 30, torch.randn(7) - 30

    def seqs(kl):
        out = [prompts[i] + comps[partner[i] if kl else i] for i in range(7)]
        return out, [[False] * len(prompts[i]) + [True] * (len(s) - len(prompts[i])) for i, s in enumerate(out)]

    def loss_and_grads(packing):
        model.zero_grad()
        with torch.no_grad():
            kl_batch = layout(*seqs(True), pad_id=0, packing=packing, packing_length=40)
            kl_sum = (sequence_logprobs(forward_logits(model, kl_batch), kl_batch) - ref_kl).sum()
        z0 = kl_reference_point(kl_sum + 200.0, torch.tensor(7))  # shifted so z0 > 0 and the clamp is inactive
        batch = layout(*seqs(False), pad_id=0, packing=packing, packing_length=40)
        if packing:
            assert batch.input_ids.shape[0] < 7 and kl_batch.input_ids.shape[0] < 7  # really packed
        loss = kto_loss(sequence_logprobs(forward_logits(model, batch), batch), ref, labels, z0, beta=0.1).mean()
        loss.backward()
        return kl_sum, z0, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    kl_pad, z_pad, loss_pad, g_pad = loss_and_grads(False)
    kl_pack, z_pack, loss_pack, g_pack = loss_and_grads(True)
    assert z_pad > 0
    torch.testing.assert_close(kl_pack, kl_pad, atol=1e-4, rtol=0)  # a sum of 7 log-probs near -30 each
    torch.testing.assert_close(z_pack, z_pad, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=0)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


# ---- data ------------------------------------------------------------------------------------------------------------

def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_unpaired_standard_and_conversational(tmp_path, tokenizer):
    std = _write(tmp_path / "std.jsonl", [
        {"prompt": "Tell me about the sea.", "completion": "It is calm.", "label": True},
        {"prompt": "Describe the park.", "completion": "It is dull.", "label": False}])
    exs = unpaired_examples(load_split(std, "train"), tokenizer, 256, 512, std)
    assert [e.label for e in exs] == [True, False]
    assert tokenizer.decode(exs[0].completion_ids) == "It is calm.<|end|>"  # eos appended to standard completions
    conv = _write(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "Describe the park."}],
                                             "completion": [{"role": "assistant", "content": "It is dull."}],
                                             "label": False}])
    (ex,) = unpaired_examples(load_split(conv, "train"), tokenizer, 256, 512, conv)
    assert tokenizer.decode(ex.prompt_ids).endswith("<|user|>Describe the park.<|end|><|assistant|>")
    assert tokenizer.decode(ex.completion_ids) == "It is dull.<|end|>" and ex.label is False


def test_paired_data_unpaired_behind_flag(tokenizer):
    """Row i of the embedded paired data -> examples 2i (chosen, desirable) and 2i+1 (rejected, undesirable)."""
    ds = load_split(TINY_PREFS, "test[:3]")
    exs = unpaired_examples(ds, tokenizer, 256, 512, "prefs")
    assert [e.label for e in exs] == [True, False] * 3
    assert exs[0].prompt_ids == exs[1].prompt_ids
    assert tokenizer.decode(exs[2].completion_ids) == ds[1]["chosen"][0]["content"] + "<|end|>"
    assert tokenizer.decode(exs[3].completion_ids) == ds[1]["rejected"][0]["content"] + "<|end|>"
    with pytest.raises(UserError, match="prefs: a paired preference dataset .* --unpair_preference_dataset"):
        unpaired_examples(ds, tokenizer, 256, 512, "prefs", unpair=False)


@pytest.mark.parametrize("label, expected", [
    (None, "row 2: missing field 'label'"),
    ("yes", "row 2: field 'label' must be true or false, got str 'yes'"),
    (1, "row 2: field 'label' must be true or false, got int 1"),
])
def test_bad_label_rows(tmp_path, tokenizer, label, expected):
    row = {"prompt": "Describe the park.", "completion": "It is dull."}
    path = _write(tmp_path / "bad.jsonl", [{**row, "label": True}, {**row, **({"label": label} if label else {})}])
    with pytest.raises(UserError) as e:
        unpaired_examples(load_split(path, "train"), tokenizer, 256, 512, path)
    assert str(e.value) == f"{path} {expected}" and "\n" not in str(e.value)


def test_mismatched_partners():
    """Fixed per example (so reference log-probs can be precomputed), never itself, never the same prompt when
    another exists, every completion used once when prompts are distinct, and deterministic in the seed."""
    prompts = [[i] for i in range(50)]
    partner = mismatched_partners(prompts, seed=3)
    assert all(j != i for i, j in enumerate(partner)) and sorted(partner) == list(range(50))
    assert partner == mismatched_partners(prompts, seed=3) != mismatched_partners(prompts, seed=4)
    siblings = [[i // 2] for i in range(40)]  # paired data unpaired: examples 2k and 2k+1 share a prompt
    assert all(siblings[j] != siblings[i] for i, j in enumerate(mismatched_partners(siblings, seed=0)))


# ---- the recipe ------------------------------------------------------------------------------------------------------

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
    return _write(tmp_path / "unpaired.jsonl", rows)


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
