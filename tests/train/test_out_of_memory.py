"""A step that runs out of memory anyway (train/out_of_memory.py), for real: SFT on the tiny model whose first step
starts under an RLIMIT_DATA a little above what the process holds then (oom_worker.py), so torch's CPU allocator
raises inside the step. Under `--max_tokens_per_microbatch auto` the step is undone and redone at half the tokens and
the run equals, metric for metric and weight for weight, a run given that budget as a number; micro-batches of one
sequence that still run out stop the run in one line with its last checkpoint untouched; a fixed budget stops at
once, in one line."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys

import pytest
import torch
from helpers import REPO, recipe_cmd, run, write_jsonl

from verl_kit.errors import main_guard
from verl_kit.models.tiny import BAD, GOOD
from verl_kit.train.out_of_memory import is_out_of_memory

# glibc's mmap threshold fixed: a freed large block goes back to the kernel at once instead of raising the
# threshold and staying in the heap, where RLIMIT_DATA keeps counting it (the steps after a redone one would run out
# on what the failed try left, an artefact of the rlimit: a GPU's caching allocator is emptied by the retry)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def long_rows(tmp_path, n: int) -> str:
    """`n` SFT text rows of ~400 tokens of the tiny tokenizer."""
    rng = random.Random(0)
    words = GOOD + BAD
    return write_jsonl(tmp_path / "long.jsonl", [{"text": " ".join(rng.choice(words) for _ in range(400))}
                                                  for _ in range(n)])


def sft(data: str, out, *extra) -> list[str]:
    return ["--dataset_name", data, "--dataset_test_split", "none", "--output_dir", str(out),
            "--packing_length", "512", "--gradient_checkpointing", "false", "--logging_steps", "1", *extra]


def under_limit(margin_gib: float, args: list[str], recipe: str = "sft.py") -> list[str]:
    """recipes/`recipe` whose first step starts under RLIMIT_DATA = its data size then + `margin_gib`."""
    return [sys.executable, str(REPO / "tests" / "train" / "oom_worker.py"), str(margin_gib),
            str(REPO / "recipes" / recipe), *args]


def digest(folder) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_what_counts_as_out_of_memory_and_the_line_it_ends_in(capsys):
    """The allocator's error classes (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, MemoryError), not
    any RuntimeError; one that no step redid ends a recipe in one line (naming the kit's or the recipe's line where it
    struck), exit 1."""
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")
    assert is_out_of_memory(cpu) and is_out_of_memory(MemoryError()) and is_out_of_memory(torch.OutOfMemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("memory"))

    @main_guard
    def recipe():
        raise cpu

    with pytest.raises(SystemExit) as stop:
        recipe()
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and "\n" not in line
    assert line.startswith("error: out of memory (") and \
        "can't allocate memory: you tried to allocate 4294967296 bytes" in line and "last checkpoint" in line


def test_a_fixed_budget_that_runs_out_stops_in_one_line(tmp_path):
    """`--max_tokens_per_microbatch 8000` (a number means that number) whose step runs out: exit 2, one line naming
    the step, the budget and what to set, no traceback, nothing exported."""
    out = tmp_path / "fixed"
    p = run(under_limit(0.01, sft(long_rows(tmp_path, 32), out, "--per_device_train_batch_size", "32",
                                  "--max_steps", "1", "--max_tokens_per_microbatch", "8000")), check=False, **MALLOC)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: step 1 ran out of memory ("), p.stderr[-3000:]
    assert "at --max_tokens_per_microbatch 8000: the run stops" in last and "auto" in last
    assert "Traceback" not in p.stderr and not (out / "final").exists()


@pytest.mark.slow
def test_a_step_that_runs_out_is_redone_at_half_the_tokens(tmp_path):
    """SFT, 128 sequences of ~400 tokens a step, no gradient checkpointing, the plan told there is room
    (--memory_limit_gib 100, so auto keeps one micro-batch of ~51k tokens). Its first step starts 1 GiB under the
    limit: the unsplit micro-batch needs more (measured ~1.6 GiB on top), the halved ones less (~0.6). The run
    warns once, halves the budget, saves it in each checkpoint and ends; a run given that budget as a number, with no
    limit, has the same metrics at every step and the same final weights: the failed try left nothing behind (no
    gradient, no optimizer step, no tally). Its checkpoint-1 resumed under 0.01 GiB: every halving runs out down to
    one sequence a micro-batch, then the run stops in one line (exit 2) and checkpoint-1 is byte for byte as it was."""
    from helpers import load_weights, numbers

    data = long_rows(tmp_path, 256)
    args = lambda out, *extra: sft(data, out, "--per_device_train_batch_size", "128", "--max_steps", "2",  # noqa: E731
                                   "--save_steps", "1", *extra)
    auto, fixed, resumed = tmp_path / "auto", tmp_path / "fixed", tmp_path / "resumed"
    p = run(under_limit(1.0, args(auto, "--memory_limit_gib", "100")), **MALLOC)
    warnings = [line for line in p.stderr.splitlines() if "ran out of memory" in line]
    budget = json.loads((auto / "checkpoint-2" / "trainer_state.json").read_text())["token_budget"]
    assert len(warnings) == 1 and "step 1 ran out of memory" in warnings[0], p.stderr[-3000:]
    assert f"redone at --max_tokens_per_microbatch {budget} " in warnings[0] and 12000 < budget < 26000, warnings
    assert json.loads((auto / "checkpoint-1" / "trainer_state.json").read_text())["token_budget"] == budget

    run(recipe_cmd("sft.py", args(fixed, "--max_tokens_per_microbatch", str(budget))))
    na, nf = numbers(auto), numbers(fixed)
    assert sorted(na) == [0, 1, 2] and all(na[s] == nf[s] for s in (1, 2)), (na, nf)
    wa, wf = load_weights(auto / "final"), load_weights(fixed / "final")
    assert all(torch.equal(wa[k], wf[k]) for k in wa)

    shutil.copytree(auto / "checkpoint-1", resumed / "checkpoint-1")
    before = digest(resumed / "checkpoint-1")
    p = run(under_limit(0.01, args(resumed, "--memory_limit_gib", "100", "--resume_from_checkpoint", "auto")),
            check=False, **MALLOC)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: step 2 ran out of memory ("), p.stderr[-3000:]
    assert "one sequence each: the run stops (the last checkpoint is intact)" in last
    assert "--gradient_checkpointing true" in last and "Traceback" not in p.stderr
    assert digest(resumed / "checkpoint-1") == before
    assert not (resumed / "checkpoint-2").exists() and not (resumed / "final").exists()


@pytest.mark.slow
def test_an_online_update_that_runs_out_is_redone(tmp_path):
    """GRPO (HF generate, 32 samples of 480 forced tokens, one micro-batch of ~15.7k tokens under auto with room to
    spare) whose first update starts 0.3 GiB under the limit: `with update:` takes the error, the update is redone
    smaller (measured: twice, to 2691 tokens), and the run equals a run given that budget as a number, metric for
    metric and weight for weight."""
    from helpers import load_weights, numbers

    args = lambda out, *extra: ["--config", "recipes/configs/grpo_tiny.yaml", "--output_dir", str(out),  # noqa: E731
                                "--max_steps", "2", "--prompts_per_step", "8", "--max_completion_length", "480",
                                "--max_prompt_length", "64", "--max_length", "544", "--ignore_eos", "true",
                                "--logging_steps", "1", "--dataset_test_split", "none", "--save_steps", "2", *extra]
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    p = run(under_limit(0.3, args(auto, "--memory_limit_gib", "100"), "grpo.py"), **MALLOC)
    budget = json.loads((auto / "checkpoint-2" / "trainer_state.json").read_text())["token_budget"]
    assert f"redone at --max_tokens_per_microbatch {budget} " in p.stderr and budget < 7830, p.stderr[-3000:]
    run(recipe_cmd("grpo.py", args(fixed, "--max_tokens_per_microbatch", str(budget))))
    na, nf = numbers(auto), numbers(fixed)
    assert sorted(na) == [1, 2] and all(na[s] == nf[s] for s in (1, 2)), (na, nf)
    wa, wf = load_weights(auto / "final"), load_weights(fixed / "final")
    assert all(torch.equal(wa[k], wf[k]) for k in wa)
