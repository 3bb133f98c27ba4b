"""LoRA (`--use_peft`, peft): the adapter merged into the weights the rollout engines get, the base model as the
reference, every recipe in one process or ZeRO-3 x2, exports peft loads (and merged), SIGKILL + resume bit-identical,
vLLM weight sync at the fp32 bound on a tied model, and bad input as one line. (GRPO with LoRA learning the embedded
task: tests/recipes/test_grpo_runs.py.)"""

import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_adapter_export,
    assert_resume_bit_identical,
    launch_cmd,
    metrics,
    recipe_cmd,
    run,
    run_until,
)

from verl_kit.config import RolloutConfig, TrainConfig, VLLMConfig, parse_args
from verl_kit.errors import UserError
from verl_kit.models import load_causal_lm, reference, with_lora
from verl_kit.rollout.weight_sync import gathered_buckets

LORA = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0"]


def lora_cfg(*args):
    return parse_args(TrainConfig, ["--use_peft", *args])


def lora_model(path, *args, seed=0):
    """The tiny policy with an adapter whose B is random (a fresh adapter adds exactly zero)."""
    model = with_lora(load_causal_lm(path, "sdpa"), lora_cfg(*args))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---- mechanism, in process ----------------------------------------------------------------------------------------





def test_target_modules_that_match_nothing(tiny_model_path):
    with pytest.raises(UserError) as e:
        with_lora(load_causal_lm(tiny_model_path, "sdpa"), lora_cfg("--lora_target_modules", "qkv,c_attn"))
    msg = str(e.value)
    assert "\n" not in msg and "--lora_target_modules qkv,c_attn: matches no module" in msg
    assert "q_proj" in msg and "down_proj" in msg, msg  # names what the model has


def test_default_targets_every_decoder_linear_not_the_output_layer(tiny_model_path):
    model = with_lora(load_causal_lm(tiny_model_path, "sdpa"), lora_cfg())
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)


def test_synced_tensors_are_the_merged_policy(tiny_model_path):
    """What the weight sync sends (and the HF-generate copy loads): every plain HF name once, the adapter merged. A
    plain model loaded with it gives the LoRA policy's logits."""
    model = lora_model(tiny_model_path)
    sent = {}
    for tensors, _ in gathered_buckets(model, 1 << 20):
        sent.update(tensors)
    plain = load_causal_lm(tiny_model_path, "sdpa").eval()
    assert set(sent) == set(dict(plain.named_parameters())), set(sent) ^ set(dict(plain.named_parameters()))
    moved = max(float((sent[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
    plain.load_state_dict(sent, strict=False)
    ids = torch.randint(3, 200, (2, 24))
    diff = float((logits(plain, ids) - logits(model, ids)).abs().max())
    assert moved > 1e-3 and diff < 1e-4, (moved, diff)


def test_output_layer_adapter_syncs_untied_and_is_refused_tied(tiny_model_path, tiny_tied_path):
    """lm_head may be adapted when it is a weight of its own (the embedded tiny model): the synced tensors give the
    LoRA policy's logits. On a tied model the output layer is the input embedding, so a merged lm_head (or
    embed_tokens) adapter would change both in the engine (measured: 1.75 nats off): refused in one line."""

    model = lora_model(tiny_model_path, "--lora_target_modules", "q_proj,lm_head")
    assert any("lm_head.lora_B" in n for n, _ in model.named_parameters())
    sent = {}
    for tensors, _ in gathered_buckets(model, 1 << 20):
        sent.update(tensors)
    plain = load_causal_lm(tiny_model_path, "sdpa").eval()
    moved = float((sent["lm_head.weight"] - plain.lm_head.weight.detach()).abs().max())
    plain.load_state_dict(sent, strict=False)
    ids = torch.randint(3, 200, (2, 24))
    diff = float((logits(plain, ids) - logits(model, ids)).abs().max())
    assert moved > 1e-3 and diff < 1e-4, (moved, diff)

    tied = tiny_tied_path
    for spec, named in (("q_proj,lm_head", "lm_head"), ("embed_tokens", "embed_tokens")):
        with pytest.raises(UserError) as e:
            with_lora(load_causal_lm(tied, "sdpa"), lora_cfg("--lora_target_modules", spec))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--lora_target_modules {spec}: this model's output layer and input "
                                                  f"embedding share one weight (tied embeddings)"), msg
        assert msg.endswith(f"leave {named} out"), msg
    with_lora(load_causal_lm(tied, "sdpa"), lora_cfg("--lora_target_modules", "q_proj,v_proj"))  # decoder layers: fine


def test_reference_is_the_base_model(tiny_model_path):
    model = lora_model(tiny_model_path)
    base = load_causal_lm(tiny_model_path, "sdpa").eval()
    ids = torch.randint(3, 200, (2, 24))
    assert float((logits(model, ids) - logits(base, ids)).abs().max()) > 1e-3  # the adapter changes the policy
    assert torch.allclose(logits(reference(model), ids), logits(base, ids), atol=1e-5)


# ---- recipes -------------------------------------------------------------------------------------------------------

QUICK = ["--max_steps", "2", "--logging_steps", "1", "--eval_steps", "2"]
RECIPES = {"dpo.py": [], "kto.py": [], "sft.py": [], "reward_model.py": [],
           "ppo.py": ["--prompts_per_step", "8"], "grpo.py": ["--prompts_per_step", "8"]}


# Every recipe once: DPO's in one process and under ZeRO-3 x2 in test_dpo_lora_zero3_matches_one_process_and_learns,
# GRPO's one process in test_grpo_lora_learns_embedded_task (tests/recipes/test_grpo_runs.py); SFT and KTO under
# ZeRO-3 share DPO's path (verl_kit.models.lora, train.Trainable, models.export_hf) and run here in one process; the
# reward model (score head) and GRPO (rollouts from the gathered, merged adapter) under ZeRO-3 x2 only: their
# one-process path is the ZeRO-3 one without the gathers. PPO's (critic adapter and value head) under ZeRO-3 x2, equal
# to one process and exported: tests/rollout/test_episodes.py::test_ppo_lora_episodes_zero3_equals_one_process.
EVERY_RECIPE = [("sft.py", 1), ("kto.py", 1), ("reward_model.py", 2), ("grpo.py", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, procs", EVERY_RECIPE)
def test_every_recipe_trains_an_adapter(recipe, procs, tmp_path):
    """One process, or ZeRO-3 over two (base weights and adapter sharded): the run ends with an adapter export that
    peft loads and a merged model with the same outputs (PPO: the critic has its own adapter and value head)."""
    out = tmp_path / "o"
    args = ["--output_dir", str(out), *QUICK, *LORA, "--learning_rate", "1e-2", *RECIPES[recipe]]
    run(recipe_cmd(recipe, args) if procs == 1 else launch_cmd("zero3.yaml", 2, recipe, args), timeout=300)
    assert_adapter_export(out / "final", classifier=recipe == "reward_model.py")


@pytest.mark.slow
def test_dpo_lora_zero3_matches_one_process_and_learns(tmp_path):
    """Same losses on ZeRO-3 x2 (4 pairs per process) as in one process (8 pairs); held-out preference accuracy
    >= 0.9 on the embedded task; both exports load in peft and merged."""
    args = [*LORA, "--max_steps", "12", "--logging_steps", "1", "--eval_steps", "12", "--learning_rate", "2e-3"]
    run(recipe_cmd("dpo.py", ["--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "8", *args]))
    run(launch_cmd("zero3.yaml", 2, "dpo.py", ["--output_dir", str(tmp_path / "z3"),
                                               "--per_device_train_batch_size", "4", *args]), timeout=300)
    one, z3 = ([r["loss"] for r in metrics(tmp_path / k) if "loss" in r] for k in ("one", "z3"))
    assert len(one) == len(z3) == 12 and max(abs(a - b) for a, b in zip(one, z3)) < 1e-4, (one, z3)
    acc = [r["eval/rewards/accuracy"] for r in metrics(tmp_path / "one") if "eval/rewards/accuracy" in r]
    print("dpo lora held-out accuracy", acc)
    assert acc[0] < 0.7 and acc[-1] >= 0.9, acc
    for k in ("one", "z3"):
        assert_adapter_export(tmp_path / k / "final")


def test_dpo_lora_tied_fsdp2_shards_and_exports(tmp_path, tiny_tied_path):
    """Fast-tier FSDP2 smoke run: DPO with an adapter on the tied tiny model under accelerate_configs/fsdp2.yaml x2
    shards every parameter (each rank holds about half; the same launch ran as unsharded DDP before FSDP2 support)
    and ends with an adapter export that peft loads and a merged model with the same outputs."""
    out = tmp_path / "fsdp2"
    run(launch_cmd("fsdp2.yaml", 2, "dpo.py", ["--output_dir", str(out), "--model_name_or_path", tiny_tied_path,
                                                "--per_device_train_batch_size", "4", "--dataset_test_split", "none",
                                                *QUICK, *LORA, "--learning_rate", "1e-2"]), timeout=300)
    head = metrics(out)[0]
    assert head["world_size"] == 2 and head["params/local"] <= 0.55 * head["params/total"], head
    assert_adapter_export(out / "final")


@pytest.mark.slow
def test_dpo_lora_tied_fsdp2_matches_one_process(tmp_path, tiny_tied_path):
    """An adapter on the tied tiny model (base frozen, embedding = output layer): FSDP2 x2 (4 pairs per process)
    gives one process's (8 pairs) step-1 gradient norm and step-3 loss."""
    args = ["--model_name_or_path", tiny_tied_path, *LORA, "--max_steps", "3", "--logging_steps", "1",
            "--dataset_test_split", "none", "--learning_rate", "1e-2", "--seed", "3"]
    run(recipe_cmd("dpo.py", ["--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "8", *args]))
    run(launch_cmd("fsdp2.yaml", 2, "dpo.py", ["--output_dir", str(tmp_path / "f2"),
                                                "--per_device_train_batch_size", "4", *args]), timeout=300)
    one, f2 = ({r["step"]: r for r in metrics(tmp_path / k)} for k in ("one", "f2"))
    print({s: (one[s]["loss"], f2[s]["loss"], one[s]["grad_norm"], f2[s]["grad_norm"]) for s in (1, 2, 3)})
    assert f2[0]["params/local"] <= 0.55 * f2[0]["params/total"]
    assert f2[1]["grad_norm"] == pytest.approx(one[1]["grad_norm"], rel=1e-4)
    assert f2[3]["loss"] == pytest.approx(one[3]["loss"], abs=1e-4) and one[3]["loss"] != one[1]["loss"]


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint holds: accelerate's model.safetensors (one process), or every rank's DeepSpeed
    module state and ZeRO-3 frozen-parameter fragments (only the non-empty ones: ZeRO-3 leaves placeholders)."""
    from safetensors.torch import load_file

    if (ckpt / "model.safetensors").is_file():
        return load_file(str(ckpt / "model.safetensors"))
    out = {}
    for f in sorted((ckpt / "pytorch_model").glob("*model_states.pt")):
        state = torch.load(f, map_location="cpu", weights_only=False)
        out.update({k: v for k, v in state["module"].items() if v.numel()})
        out.update(state.get("frozen_param_fragments") or {})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_lora_sigkill_then_resume_is_bit_identical(procs, tmp_path, tiny_tied_path):
    """Under ZeRO-3 x2 the adapter and its AdamW state come back exactly: the resumed run ends with the uninterrupted
    run's adapter. The checkpoints hold the adapter, not the frozen base model (which the resumed run loads from
    --model_name_or_path). One process (its bit-identical LoRA resume is the distillation recipe's,
    tests/recipes/test_distill_runs.py): the killed run's checkpoint resumed onto another base model, or with another
    rank, is refused in one line, and one whose weights lack part of the adapter too."""
    from safetensors.torch import save_file

    args = [*LORA, "--max_steps", "8", "--save_steps", "4",
            "--eval_steps", "8", "--logging_steps", "2", "--learning_rate", "1e-2",
            "--per_device_train_batch_size", str(8 // procs)]
    launch = (lambda a: recipe_cmd("dpo.py", a)) if procs == 1 else (lambda a: launch_cmd("zero3.yaml", 2, "dpo.py", a))
    cmd = lambda out, *extra: launch(["--output_dir", str(out), *args, *extra])
    first = 4

    def checkpoint_holds_the_adapter_only(crashed):
        saved = checkpoint_tensors(crashed / f"checkpoint-{first}")
        assert not [k for k in saved if "lora_" not in k], sorted(saved)[:5]  # no base weight
        assert procs == 2 or saved  # ZeRO-3 keeps the adapter's values in its optimizer partitions only
        if procs == 2:
            return
        other_base = tiny_tied_path
        for flag, value in (("--model_name_or_path", other_base), ("--lora_r", "4")):
            p = run(cmd(crashed, flag, value, "--resume_from_checkpoint", "auto"), check=False)
            last = p.stderr.strip().splitlines()[-1]
            assert p.returncode != 0 and f"checkpoint-{first}: saved with {flag} " in last, p.stderr[-2000:]
        # A checkpoint whose weights lack part of the adapter is refused, not loaded non-strictly.
        broken = tmp_path / "broken" / f"checkpoint-{first}"
        shutil.copytree(crashed / f"checkpoint-{first}", broken)
        save_file(dict(list(saved.items())[1:]), str(broken / "model.safetensors"))
        p = run(cmd(broken.parent, "--resume_from_checkpoint", str(broken)), check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode != 0 and "model.safetensors does not hold this run's trainable weights (missing" in last, (
            p.stderr[-2000:])

    if procs == 1:
        run_until(cmd(tmp_path / "crashed"),
                  lambda: (tmp_path / "crashed" / f"checkpoint-{first}" / "trainer_state.json").is_file())
        checkpoint_holds_the_adapter_only(tmp_path / "crashed")
        return
    assert_resume_bit_identical(cmd, tmp_path / "full", tmp_path / "crashed", first,
                                weights="adapter_model.safetensors", before_resume=checkpoint_holds_the_adapter_only)


# ---- vLLM: the engine follows the adapter after every sync, and loads the merged export ---------------------------

@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("rollout", ["vllm", "vllm-server"])
def test_grpo_lora_vllm_sync_on_tied_model(tiny_tied_path, tmp_path, rollout):
    """GRPO with an adapter on a tied-embedding model, a high learning rate, vLLM engines that serve the adapter
    (vLLM's LoRA over the base weights), colocated or the run's own server (started with LoRA; the adapter loaded
    through its /v1/load_lora_adapter): every sync sends the adapter alone (its bytes: the adapter's parameters, a
    fraction of the model's) and after it the engine's log-probs match the trainer's (adapter enabled) within the
    fp32 bound while the trainer moves. final/merged is a plain HF directory that scores like peft's adapter on the
    base: assert_adapter_export."""
    model = tiny_tied_path
    out = tmp_path / "run"
    t0 = time.time()
    run(recipe_cmd("grpo.py", [*LORA, "--model_name_or_path", model, "--rollout", rollout, "--vllm_lora_sync",
                               "adapter", "--vllm_probe_threshold", "1e-3", "--learning_rate", "1e-2",
                               "--output_dir", str(out), "--max_steps", "2", "--prompts_per_step", "8",
                               "--logging_steps", "1", "--dataset_test_split", "none"]),
        timeout=420, VLLM_HOST_IP="127.0.0.1")
    rows = [r for r in metrics(out) if "rollout/logprob_max_abs_diff" in r]
    print(f"grpo lora {rollout} {time.time() - t0:.1f}s: "
          f"{[(r['rollout/logprob_max_abs_diff'], r['rollout/probe_trainer_moved']) for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_max_abs_diff"] < 1e-3 for r in rows), rows
    assert all(r["rollout/probe_trainer_moved"] > 1e-2 for r in rows), rows  # the adapter moved the policy
    adapter = sum(p.numel() * 4 for n, p in lora_model(model, *LORA[1:]).named_parameters() if ".lora_" in n)
    whole = sum(p.numel() * 4 for p in load_causal_lm(model, "sdpa").parameters())
    assert all(r["sync/adapter_only"] == 1 and r["sync/bytes"] == adapter for r in rows), rows
    print(f"adapter-only sync: {adapter} bytes, {adapter / whole:.3f} of the model's {whole}")
    assert_adapter_export(out / "final")


def test_which_lora_sync_a_run_takes(tiny_model_path):
    """rollout.backends.served_adapter_rank: the adapter's rank where the engines serve it, else None (the merged sync)
    with the reason in the run's one line: --vllm_lora_sync adapter on the colocated engine and on the run's own or a
    named server on this host; merged for --partial_rollout (a request keeps the adapter it started with), for a
    server on another host (it cannot read this host's files), for servers the run did not start under auto, under
    auto on CPU, and for an adapter vLLM cannot serve; None without an adapter or a vLLM engine."""
    from types import SimpleNamespace

    from verl_kit.rollout.backends import served_adapter_rank

    actor = lora_model(tiny_model_path, "--lora_r", "4")
    main = SimpleNamespace(is_main_process=True)

    def rank(model=actor, rollout="vllm-server", lora_sync="adapter", url=None, **flags):
        return served_adapter_rank(RolloutConfig(rollout=rollout, **flags),
                                   VLLMConfig(vllm_lora_sync=lora_sync, vllm_server_url=url), main, model)

    assert rank() == rank(rollout="vllm") == rank(url="http://127.0.0.1:8000,http://localhost:8001") == 4
    for merged in (dict(async_rollout=True, partial_rollout=True), dict(url="https://10.0.0.2:8000"),
                   dict(lora_sync="merged"), dict(rollout="vllm", lora_sync="auto"),
                   dict(model=lora_model(tiny_model_path, "--lora_target_modules", "q_proj,lm_head"))):
        assert rank(**merged) is None, merged
    if not torch.cuda.is_available():
        assert rank(lora_sync="auto") is None  # the run's own server, auto, on CPU
    assert rank(url="http://127.0.0.1:8000", lora_sync="auto") is None  # not the run's own: maybe without LoRA
    assert rank(rollout="hf") is None
    assert rank(model=load_causal_lm(tiny_model_path, "sdpa")) is None


def test_which_adapters_vllm_serves(tiny_model_path):
    """models.lora.vllm_unservable: every decoder linear (the default) is served; an output-layer adapter is not (the
    merged sync then, with this phrase); a plain model has no adapter."""
    from verl_kit.models.lora import vllm_unservable

    assert vllm_unservable(lora_model(tiny_model_path)) is None
    assert vllm_unservable(lora_model(tiny_model_path, "--lora_target_modules", "q_proj,v_proj")) is None
    assert vllm_unservable(lora_model(tiny_model_path, "--lora_target_modules", "q_proj,lm_head")) == \
        "vLLM's LoRA does not serve lm_head"
    assert vllm_unservable(load_causal_lm(tiny_model_path, "sdpa")) == "no adapter"
