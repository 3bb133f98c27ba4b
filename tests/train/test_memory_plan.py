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
import torch
from helpers import REPO, env, recipe_cmd, run

from verl_kit.errors import UserError
from verl_kit.train import memory_plan as mp

GIB = 2 ** 30


def test_terms_by_hand(tiny_model_path):
    """Activations: tokens x layers x (12 h + 2 kv + 4 m) x 4 B without checkpointing (SmolLM2: h 576, 3 KV heads of
    64, m 1536: 1.61 MB a token, docs/memory.md's measured 1.57-1.64), tokens x (layers x h x 4 + two layers') with
    it, half the width under bf16. The largest micro-batch: the k longest items, or the token budget but never below
    the longest item. A LoRA adapter counted on the meta model equals peft's trainable parameters on the real one."""
    smol = types.SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3)
    layer = (12 * 576 + 2 * 3 * 64 + 4 * 1536) * 4
    assert mp.activation_bytes(smol, 1, False, False) == 30 * layer == 1_612_800
    assert mp.activation_bytes(smol, 10, True, False) == 10 * (30 * 576 * 4 + 2 * layer)
    assert mp.activation_bytes(smol, 1, False, True) == 1_612_800 // 2
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


def test_auto_budget_splits_only_what_would_not_fit(tiny_model_path, monkeypatch):
    """--max_tokens_per_microbatch auto (the default): with room to spare the micro-batches stay as they are (no
    budget); when the unsplit micro-batch would take the plan past --memory_fraction of --memory_limit_gib, the budget
    is the largest one whose plan fits (one token more does not), never below the longest item; a number is that
    number. Under a limit that even one item exceeds, no budget: the plan is refused as before."""
    from verl_kit.config import TrainConfig

    monkeypatch.setattr(mp, "_rss_now", lambda: GIB // 2)  # the process's own term, fixed for the arithmetic
    acc = types.SimpleNamespace(num_processes=1, sharding=types.SimpleNamespace(name="none"), is_main_process=True)
    costs = [500] * 60 + [900]  # the largest micro-batch of 32: 900 + 31 x 500 = 16400 tokens
    tc = lambda **kw: TrainConfig(output_dir="unused", per_device_train_batch_size=32,  # noqa: E731
                                  gradient_checkpointing=False, **kw)

    unsplit = mp.plan(acc, tc(max_tokens_per_microbatch="none", memory_limit_gib=100.0), tiny_model_path, costs)
    grows = unsplit.terms["activations"] + unsplit.terms["LM-head tiles"]
    fixed = unsplit.total - grows
    roomy = tc(memory_limit_gib=100.0)
    assert mp.plan(acc, roomy, tiny_model_path, costs).total == pytest.approx(unsplit.total)
    assert roomy.max_tokens_per_microbatch == "auto" and roomy.token_budget is None

    limit = (fixed + grows / 3) / 0.85  # a third of the unsplit micro-batch fits 0.85 of it
    auto = tc(memory_limit_gib=limit)
    fitted = mp.plan(acc, auto, tiny_model_path, costs)
    budget = auto.token_budget
    assert 900 <= budget < 16400 / 2 and fitted.total <= 0.85 * limit + 1e-9
    assert "at most" in fitted.notes["activations"]
    over = mp.plan(acc, tc(max_tokens_per_microbatch=str(budget + 1), memory_limit_gib=100.0), tiny_model_path, costs)
    assert over.total > 0.85 * limit  # the largest that fits
    fixed_cfg = tc(max_tokens_per_microbatch=str(budget), memory_limit_gib=limit)
    assert mp.plan(acc, fixed_cfg, tiny_model_path, costs).total == pytest.approx(fitted.total)
    assert fixed_cfg.token_budget == budget and fixed_cfg.max_tokens_per_microbatch == budget

    one = mp.plan(acc, tc(max_tokens_per_microbatch="900", memory_limit_gib=100.0), tiny_model_path, costs)
    tight = tc(memory_limit_gib=(one.total - 0.5 * (one.total - fixed)) / 0.85)  # one item alone does not fit
    with pytest.raises(UserError, match="its largest term is"):
        mp.plan(acc, tight, tiny_model_path, costs)
    assert tight.token_budget is None


@pytest.mark.slow
def test_auto_budget_run_equals_its_fixed_budget_and_resumes_with_it(tmp_path):
    """SFT on the tiny model, 256 sequences a micro-batch without checkpointing (~0.2 GiB of activations), under a
    --memory_limit_gib whose 0.85 leaves a third of that beside the rest of the plan: auto splits the micro-batches
    (measured: at most ~2200 tokens of 7781) and records the budget in each checkpoint. The run equals, metric for
    metric and weight for weight, a run given that budget as a number; its checkpoint-2 resumed under a limit where
    auto would not split keeps the checkpoint's budget and ends with the same weights."""
    import shutil

    from helpers import load_weights, metrics, numbers

    def cmd(out, *extra):
        return recipe_cmd("sft.py", ["--config", "recipes/configs/sft_tiny.yaml", "--output_dir", str(out),
                                     "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
                                     "--per_device_train_batch_size", "256", "--gradient_checkpointing", "false",
                                     "--dataset_test_split", "none", *extra])

    # the limit from this machine's plan of the run (the process's own size differs between installs: 0.51 GiB here,
    # 0.64 in a fresh clone): a third of the unsplit micro-batch fits 0.85 of it
    probe, auto, fixed, resumed = tmp_path / "probe", tmp_path / "auto", tmp_path / "fixed", tmp_path / "resumed"
    run(cmd(probe, "--max_steps", "1", "--memory_limit_gib", "100"))
    plan = metrics(probe)[0]
    grows = plan["memory/plan_activations_gib"] + plan["memory/plan_LM-head_tiles_gib"]
    limit = (plan["memory/plan_total_gib"] - grows + grows / 3) / 0.85
    p = run(cmd(auto, "--memory_limit_gib", f"{limit:.4f}"))
    budget = json.loads((auto / "checkpoint-2" / "trainer_state.json").read_text())["token_budget"]
    assert isinstance(budget, int) and 128 <= budget < 7781, budget
    assert f"micro-batches of at most {budget} tokens (--max_tokens_per_microbatch auto" in p.stderr
    run(cmd(fixed, "--max_tokens_per_microbatch", str(budget)))
    na, nf = numbers(auto), numbers(fixed)
    assert sorted(na) == [0, 1, 2, 3, 4] and all(na[s] == nf[s] for s in (1, 2, 3, 4)), (na, nf)
    wa, wf = load_weights(auto / "final"), load_weights(fixed / "final")
    assert all(torch.equal(wa[k], wf[k]) for k in wa)
    shutil.copytree(auto / "checkpoint-2", resumed / "checkpoint-2")
    p = run(cmd(resumed, "--memory_limit_gib", "100", "--resume_from_checkpoint", "auto"))
    assert f"keeps its budget {budget} (the plan chose None now)" in p.stderr, p.stderr[-2000:]
    wr = load_weights(resumed / "final")
    assert all(torch.equal(wa[k], wr[k]) for k in wa)


def test_the_rollout_engines_share_of_the_trainer(tiny_model_path):
    """A colocated vLLM engine on CPU: the trainer also holds vllm's library (0.28 GiB, measured) and the weight-sync
    slots (4 B per parameter), its "rollout client" term; HF generate on the trained model itself (one unsharded
    process) counts its KV cache only, on a sharded one the copy of the policy too."""
    import types

    from verl_kit.config import RolloutConfig, TrainConfig, VLLMConfig

    n = mp.parameter_count(tiny_model_path)
    tc = TrainConfig(output_dir="unused", memory_limit_gib=100.0)
    acc = lambda whole: types.SimpleNamespace(num_processes=1, is_main_process=True,  # noqa: E731
                                              sharding=types.SimpleNamespace(name="none", whole=whole))
    plan = lambda backend, whole=True: mp.plan(acc(whole), tc, tiny_model_path, [[5] * 20],  # noqa: E731
                                                rollout=RolloutConfig(rollout=backend), vllm=VLLMConfig())
    colocated = plan("vllm")
    assert colocated.terms["rollout client"] == pytest.approx((mp.VLLM_LIBRARY_BYTES + 4 * n) / GIB)
    shared, copied = plan("hf"), plan("hf", whole=False)
    assert "rollout client" not in shared.terms and "on the trained model" in shared.notes["rollout engine"]
    assert copied.terms["rollout engine"] - shared.terms["rollout engine"] == pytest.approx(4 * n / GIB)
    # HF generate's KV cache: the samples generated at once (prompts per process x generations) at the longest
    # prompt + completion, fp32, K and V of every layer; it never coexists with the update's activations and tiles,
    # so the total counts the larger of the two
    config = mp.meta_model(tiny_model_path).config
    head_dim = config.hidden_size // config.num_attention_heads
    for generations in (1, 64):
        rollout = RolloutConfig(rollout="hf", prompts_per_step=8, max_completion_length=50)
        p = mp.plan(acc(True), tc, tiny_model_path, [[5] * 20, [5] * 30], generations=generations, rollout=rollout,
                    vllm=VLLMConfig())
        kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * 8 * generations * 80 / GIB
        assert p.terms["KV cache"] == pytest.approx(kv)
        update = p.terms["activations"] + p.terms["LM-head tiles"]
        rest = sum(v for k, v in p.terms.items() if k not in ("KV cache", "activations", "LM-head tiles"))
        assert p.total == pytest.approx(rest + max(kv, update)) and (kv > update) == (generations == 64)
