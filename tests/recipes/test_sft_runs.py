"""recipes/sft.py as a user runs it: it learns held-out replies, its export replies kindly, it survives SIGKILL
bit-identically, and runs on ZeRO-3 across two processes (and with token-budget micro-batches) with the
single-process numbers. (Its data formats and maths: tests/data/test_sft_data.py.)"""

import pytest
import torch
from helpers import REPO, assert_resume_bit_identical, launch_cmd, load_weights, metrics, recipe_cmd, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    # One epoch over the 2000 embedded conversations (250 steps of 8), the shipped tiny config.
    run(recipe_cmd("sft.py", ["--config", str(REPO / "recipes/configs/sft_tiny.yaml"), "--output_dir", str(out)]),
        timeout=300)
    return out


@pytest.mark.slow
def test_sft_learns_held_out_replies(trained, tiny_model_path):
    rows = metrics(trained)
    evals = [r for r in rows if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 250
    assert evals[0]["eval/loss"] > 6.0  # about log(vocab): the random tiny model
    assert evals[-1]["eval/loss"] < 1.2, evals  # measured 0.87 (the replies' own entropy is most of what remains)
    assert evals[-1]["eval/perplexity"] < 3.4
    before, after = load_weights(tiny_model_path), load_weights(trained / "final")
    assert [k for k in before if torch.equal(before[k], after[k])] == []  # every parameter moved


@pytest.mark.slow
def test_sft_export_replies_kindly(trained):
    """The exported model and tokenizer load with plain transformers; greedy replies to held-out prompts take the
    task's form and use kind words only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_kit.models import BAD, GOOD

    tok = AutoTokenizer.from_pretrained(trained / "final")
    model = AutoModelForCausalLM.from_pretrained(trained / "final")
    for ask in ("Tell me about the lake.", "Describe the harbour."):
        enc = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=30, do_sample=False, pad_token_id=tok.pad_token_id)
        words = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).lower().replace(",", " ")
        words = words.replace(".", " ").split()
        assert any(w in GOOD for w in words) and not any(w in BAD for w in words), words


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """SIGKILL once checkpoint-10 is complete, resume with `auto`: the final weights equal the uninterrupted run's
    bit for bit, and so do the held-out evaluations and losses of steps 20 and 30."""
    args = ["--max_steps", "30", "--save_steps", "10", "--save_total_limit", "2", "--eval_steps", "10",
            "--logging_steps", "5", "--learning_rate", "1e-3"]
    cmd = lambda out, *extra: recipe_cmd("sft.py", ["--output_dir", str(out), *args, *extra])
    assert_resume_bit_identical(cmd, tmp_path / "full", tmp_path / "crashed", 10, compare_steps=(20, 30))


# Global batch 8 sequences per step: 1 process x 8, 2 processes x 4, or 8 split by a token budget.
COMMON = ["--max_steps", "3", "--logging_steps", "1", "--dataset_test_split", "none", "--seed", "3"]


def by_step(out, key):
    return {r["step"]: r[key] for r in metrics(out) if key in r}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(recipe_cmd("sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "8", *COMMON]))
    return out


def assert_matches(out, single_run, later_tol):
    """Step 1 runs at the same initial weights: its token-mean loss and the gradient norm of the whole step must
    agree however the 8 sequences were split; later steps follow the updates."""
    for key in ("loss", "grad_norm"):
        a, b = by_step(out, key), by_step(single_run, key)
        assert abs(a[1] - b[1]) < 1e-4 * max(1.0, b[1]), (key, a, b)
    a, b = by_step(out, "loss"), by_step(single_run, "loss")
    assert all(abs(a[s] - b[s]) < later_tol for s in (2, 3)), (a, b)


@pytest.mark.slow
def test_zero3_two_processes_match_single_process(tmp_path, single_run):
    out = tmp_path / "z3"
    run(launch_cmd("zero3.yaml", 2, "sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "4",
                                                *COMMON]), timeout=300)
    head = metrics(out)[0]
    assert head["world_size"] == 2 and head["params/local"] <= 0.55 * head["params/total"]
    assert_matches(out, single_run, later_tol=1e-3)
    exported = load_weights(out / "final")  # the ZeRO-3 shards gathered into one HF checkpoint
    assert sum(t.numel() for t in exported.values()) == head["params/total"]


@pytest.mark.slow
def test_token_budget_microbatches_match(tmp_path, single_run):
    out = tmp_path / "budget"
    run(recipe_cmd("sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "8",
                              "--max_tokens_per_microbatch", "60", *COMMON]))
    assert_matches(out, single_run, later_tol=1e-4)
