"""recipes/dpo.py as a user runs it: it learns on the embedded task, every parameter moves, the HF export loads
and generates, and user mistakes end with one line and exit code 2."""

import os

import pytest
import torch
from helpers import REPO, load_weights, metrics, recipe_cmd, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("dpo")
    # One epoch over the 2000 embedded pairs (250 steps of 8), the recipe's defaults but for the output dir.
    p = run(recipe_cmd("dpo.py", ["--output_dir", str(out), "--eval_steps", "100"]), timeout=600)
    return out, p


@pytest.mark.slow
def test_dpo_learns_held_out_preferences(trained):
    out, p = trained
    rows = metrics(out)
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 250
    assert evals[-1]["eval/rewards/accuracy"] >= 0.9, evals
    assert evals[-1]["eval/rewards/margin"] > evals[0]["eval/rewards/margin"] + 1.0
    train = [r for r in rows if "loss" in r]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    assert all(r["perf/tokens_per_s"] > 0 for r in train)
    assert (out / "curves.png").stat().st_size > 1000
    assert "step 250: loss=" in p.stderr  # the INFO line


@pytest.mark.slow
def test_every_parameter_changed(trained, tiny_model_path):
    out, _ = trained
    before, after = load_weights(tiny_model_path), load_weights(out / "final")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged


@pytest.mark.slow
def test_hf_export_loads_and_generates(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tok.decode(gen[0]), str)


def _fails(args, expected, tmp_path, timeout=120):
    p = run(recipe_cmd("dpo.py", ["--output_dir", str(tmp_path / "o"), *args]), timeout=timeout, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    return last


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--beta_typo", "0.2"], "unknown flag(s) --beta_typo"),
    (["--beta", "high"], "invalid float value: 'high'"),
    (["--loss_type", "hinge2"], "--loss_type: 'hinge2' is not one of sigmoid, ipo"),
    (["--model_name_or_path", "/nonexistent/model"], "--model_name_or_path /nonexistent/model: no such directory"),
    (["--model_name_or_path", "nobody/no-such-model"], "--model_name_or_path nobody/no-such-model: not found"),
    (["--dataset_name", "/nonexistent/data.jsonl"], "--dataset_name /nonexistent/data.jsonl: no such file"),
])
def test_user_errors_are_one_line(tmp_path, args, expected):
    _fails(args, expected, tmp_path)


@pytest.mark.slow
def test_bad_row_and_unwritable_output(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    _fails(["--dataset_name", str(data)], f"{data} row 2: missing field 'rejected'", tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run(recipe_cmd("dpo.py", ["--output_dir", str(blocker / "sub"), "--max_steps", "1"]), check=False)
    assert p.returncode == 2 and "--output_dir" in p.stderr.strip().splitlines()[-1]
    assert blocker.read_text() == "x"


@pytest.mark.slow
def test_bad_input_damages_nothing_saved(tmp_path):
    """A failed restart (bad data) must leave existing checkpoints and metrics as they were."""
    out = tmp_path / "run"
    run(recipe_cmd("dpo.py", ["--output_dir", str(out), "--max_steps", "4", "--save_steps", "2",
                              "--dataset_test_split", "none"]))
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "chosen": "", "rejected": "c"}\n')
    p = run(recipe_cmd("dpo.py", ["--output_dir", str(out), "--dataset_name", str(data),
                                  "--resume_from_checkpoint", "auto"]), check=False)
    assert p.returncode == 2
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == snapshot
    assert sorted(os.listdir(out)) == sorted(["checkpoint-2", "checkpoint-4", "curves.png", "final", "metrics.jsonl"])


@pytest.mark.slow
@pytest.mark.parametrize("tracker, pattern", [("tensorboard", "**/events.out.tfevents.*"),
                                              ("wandb", "wandb/offline-run-*")])
def test_report_to_trackers(tmp_path, tracker, pattern):
    out = tmp_path / "o"
    run(recipe_cmd("dpo.py", ["--output_dir", str(out), "--max_steps", "2", "--logging_steps", "1",
                              "--dataset_test_split", "none", "--report_to", tracker]),
        WANDB_DIR=str(tmp_path), WANDB_MODE="offline")
    where = out if tracker == "tensorboard" else tmp_path
    assert list(where.glob(pattern)), sorted(p.name for p in tmp_path.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "recipes" / "configs").glob("*.yaml")))
def test_shipped_configs_parse(config):
    """Every shipped yaml names only known flags of its recipe (dpo_*.yaml -> dpo.py, reward_model_*.yaml ->
    reward_model.py, ...) with valid types
    (--help exits 0 only after the config is validated)."""
    recipe = max((r.name for r in (REPO / "recipes").glob("*.py") if config.startswith(r.stem + "_")), key=len)
    p = run(recipe_cmd(recipe, ["--config", str(REPO / "recipes" / "configs" / config), "--help"]), check=False)
    assert p.returncode == 0, p.stderr[-1000:]
