"""The memory plan (verl_kit.train.memory_plan): its terms by hand (activations, the largest micro-batch, a LoRA
adapter's size against peft's own count, the model state under each sharding), the budget from rlimits and
--memory_limit_gib, a run that cannot fit refused in one line before any weight is loaded, and the plan of a run
next to its measured peak."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from helpers import REPO, env, recipe_cmd, run

from verl_kit.train import memory_plan as mp

GIB = 2 ** 30


def test_terms_by_hand(tiny_model_path):
    """Activations: tokens x layers x (10 h + 4 m) x 4 B without checkpointing (h 576, m 1536: 46.5 KiB per token per
    layer, docs/memory.md's SmolLM2 figure), tokens x (layers x h x 4 + one layer's) with it, half the width under
    bf16. The largest micro-batch: the k longest items, or the token budget but never below the longest item. A
    LoRA adapter counted on the meta model equals peft's trainable parameters on the real one."""
    smol = types.SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    assert mp.activation_bytes(smol, 1, False, False) == 30 * (10 * 576 + 4 * 1536) * 4 == 1_428_480
    assert mp.activation_bytes(smol, 10, True, False) == 10 * (30 * 576 * 4 + 47_616)
    assert mp.activation_bytes(smol, 1, False, True) == 1_428_480 // 2
    assert mp.largest_microbatch([5, 90, 20, 40], 2, None) == 130
    assert mp.largest_microbatch([5, 90, 20, 40], 2, 100) == 100
    assert mp.largest_microbatch([5, 90, 20, 40], 2, 50) == 90  # an item is never split
    from peft import LoraConfig, get_peft_model

    from verl_kit.models import load_causal_lm
    model = load_causal_lm(tiny_model_path)
    n = mp.parameter_count(tiny_model_path)
    assert n == sum(p.numel() for p in model.parameters())
    for targets in (None, "q_proj,v_proj"):
        peft = get_peft_model(load_causal_lm(tiny_model_path), LoraConfig(
            r=8, target_modules=targets.split(",") if targets else "all-linear"))
        trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        assert mp.adapter_count(mp.meta_model(tiny_model_path), 8, targets) == trainable, targets


BUDGET = r"""
import json, resource, sys
from verl_kit.train.memory_plan import budget
resource.setrlimit(resource.RLIMIT_DATA, (int(sys.argv[1]) * 2**30, resource.RLIM_INFINITY))
b = budget(int(sys.argv[2]), None)
print(json.dumps([b.limit, b.available, b.sources]))
"""


def test_budget_takes_the_smallest_limit_shared_by_the_nodes_processes():
    """Under RLIMIT_DATA 6 GiB (a limit of each process) the limit is 6 GiB per process whatever the node's count;
    MemTotal divides among the node's processes; --memory_limit_gib replaces them all."""
    for procs in (1, 2):
        p = subprocess.run([sys.executable, "-c", BUDGET, "6", str(procs)], cwd=REPO, env=env(), capture_output=True,
                           text=True, timeout=120)
        limit, available, sources = json.loads(p.stdout.strip().splitlines()[-1])
        assert sources["RLIMIT_DATA"] == 6 * procs and limit == pytest.approx(min(6.0, sources["MemTotal"] / procs))
        assert available <= limit
    assert mp.budget(2, 3.5).limit == 3.5 and mp.budget(2, 3.5).sources == {"--memory_limit_gib": 3.5}


def test_a_run_that_cannot_fit_is_refused_before_loading(tmp_path):
    """SFT on the tiny model under --memory_limit_gib 0.2: exit 2, one line naming the plan, the limit, the largest
    term and what moves it, before any weight is loaded (nothing written to --output_dir but its log). Every recipe's
    plan beside its measured peak: tests/recipes/test_all_recipes.py::test_two_steps_end_to_end."""
    out = tmp_path / "sft"
    p = run(recipe_cmd("sft.py", ["--output_dir", str(out), "--max_steps", "2", "--memory_limit_gib", "0.2"]),
            check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: this run needs about 0.") and "may use 0.2 GiB" in last, \
        p.stderr[-2000:]
    assert "its largest term is this process" in last and "--memory_limit_gib" in last
    assert not (out / "final").exists() and not list(out.glob("checkpoint-*"))
