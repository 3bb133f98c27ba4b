"""GRPO: group-relative advantages by hand, the recipe learning the embedded task, a 2-process ZeRO-3 run with several
updates per rollout, and SIGKILL + `--resume_from_checkpoint auto` ending bit-identical to an uninterrupted run."""

import pytest
import torch
from helpers import assert_resume_bit_identical, launch_cmd, load_weights, metrics, numbers, recipe_cmd, run

from verl_kit.algos import group_advantages, loss_weights

TINY = "recipes/configs/grpo_tiny.yaml"


def test_group_advantages_by_hand():
    """Two groups of 4. [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so +-0.5 / (0.57735 +
    1e-4) = +-0.86588. [2, 2, 2, 2]: all equal, 0. Unscaled (Dr. GRPO): +-0.5 and 0. Groups of 2: [1, 0] has std
    sqrt(2 * 0.25 / 1) = 0.70711, so +-0.5 / 0.70721 = +-0.70700."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = 0.5 / ((1.0 / 3.0) ** 0.5 + 1e-4)
    torch.testing.assert_close(group_advantages(scores, 4), torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    assert abs(a - 0.86588) < 1e-5
    torch.testing.assert_close(group_advantages(scores, 4, scale=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    b = 0.5 / (0.5 ** 0.5 + 1e-4)
    torch.testing.assert_close(group_advantages(scores, 2), torch.tensor([b, -b, -b, b, 0, 0, 0, 0]))
    assert abs(b - 0.70700) < 1e-5


def test_loss_weights_by_hand_and_split_invariant():
    """Two responses of 1 and 3 tokens with per-token losses [4] and [1, 2, 3], max_len 4.
    token:    (4 + 1 + 2 + 3) / 4 tokens = 2.5
    sequence: (4 / 1 + 6 / 3) / 2 responses = 3.0
    dr_grpo:  (4 + 1 + 2 + 3) / (2 responses * 4) = 1.25
    and the same sums when the 4 tokens are split over 2 ranks and micro-batches (each rank's share times world=2,
    then averaged over ranks, as DDP/DeepSpeed do)."""
    loss = torch.tensor([4.0, 1.0, 2.0, 3.0])
    row_len = torch.tensor([1, 3, 3, 3])
    for kind, want in (("dapo", 2.5), ("grpo", 3.0), ("dr_grpo", 1.25)):
        w = loss_weights(kind, row_len, global_tokens=4, global_seqs=2, max_len=4)
        assert float((loss * w).sum()) == pytest.approx(want)
        ranks = [[[0], [1]], [[2, 3]]]  # rank 0: two micro-batches, rank 1: one
        shares = [sum(float((loss[c] * w[c]).sum()) * 2 for c in chunks) for chunks in ranks]
        assert sum(shares) / 2 == pytest.approx(want)
    with pytest.raises(ValueError, match="loss_type 'mean'"):
        loss_weights("mean", row_len, 4, 2, 4)


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
        "--dataset_test_split", "test[:32]", *extra])


@pytest.mark.slow
def test_grpo_zero3_two_processes_resume_bit_identical(tmp_path, tiny_model_path):
    """2 processes, ZeRO-3 (actor engine, sharded reference), 2 passes x 2 minibatches per rollout (old log-probs
    recomputed), token-budget micro-batches, per-response loss means (`--loss_type grpo`), every sample a
    multi-turn episode of the example feedback environment (docs/environments.md), DAPO's dynamic sampling (the
    random model's groups mostly score all 0: flat ones are dropped and up to 2 more batches of episodes generated,
    each rank keeping as many groups as the other). Run A goes straight to step 4; run B is SIGKILLed once
    checkpoint-2 is complete and resumed with `auto`: its final weights equal A's bit for bit, and so do the metrics
    of steps 3-4."""
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
