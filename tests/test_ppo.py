"""PPO end to end: the rollout backend (sampling log-probs, EOS), the recipe learning the embedded task, a 2-process
ZeRO-3 run with a reward model of another vocabulary, and SIGKILL + `--resume_from_checkpoint auto` ending
bit-identical to an uninterrupted run."""

import types

import pytest
import torch
from helpers import assert_resume_bit_identical, launch_cmd, load_weights, metrics, numbers, recipe_cmd, run

from verl_kit.data import logprobs_from_logits
from verl_kit.rollout import HFGenerateBackend, SamplingParams
from verl_kit.train import actor_logits, pack_responses

TINY = "recipes/configs/ppo_tiny.yaml"


def test_rollout_logprobs_and_eos(tiny_model_path, tokenizer):
    """Sampling log-probs equal the model's own log-probs at the sampling temperature, also as the recipe computes
    them (packed or padded responses, actor_logits): so `--old_logprobs rollout` may use them. Then the same draw is
    repeated with a token that occurred as the EOS: the RNG stream is the same, so each response is the first
    one cut just after that token's first occurrence, with the mask ending there and `truncated` False."""
    from verl_kit.models import load_causal_lm

    actor = load_causal_lm(tiny_model_path).eval()
    prompts = [tokenizer("<|user|>Describe the sea.<|end|><|assistant|>")["input_ids"], [5, 6, 7]]
    params = SamplingParams(temperature=0.7, max_new_tokens=12, n=3)
    engine = HFGenerateBackend(actor, tokenizer, "cpu", torch.float32)
    torch.manual_seed(1)
    first = engine.generate(prompts, params)
    assert first.response_ids.shape == (6, 12) and first.truncated.all() and first.response_mask.all()
    assert first.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3
    with torch.no_grad():
        for b in range(6):
            seq = torch.tensor([first.prompt_ids[b] + first.response_ids[b].tolist()])
            P = len(first.prompt_ids[b])
            lp = (actor(seq).logits[0, P - 1:-1] / 0.7).log_softmax(-1).gather(-1, seq[0, P:, None]).squeeze(-1)
            torch.testing.assert_close(first.sampling_logprobs[b], lp, atol=1e-4, rtol=1e-4)
        for packing in (True, False):
            batch, ix = pack_responses(first.prompt_ids, first.response_ids, first.response_mask, list(range(6)),
                                       tokenizer.pad_token_id, packing, 64, True)
            lp = logprobs_from_logits(actor_logits(actor, batch, ix, 0.7), ix.targets)
            torch.testing.assert_close(lp, first.sampling_logprobs[ix.row, ix.pos], atol=1e-4, rtol=1e-4)
    stop = int(first.response_ids[0, 4])
    engine.tokenizer = types.SimpleNamespace(pad_token_id=tokenizer.pad_token_id, eos_token_id=stop)
    torch.manual_seed(1)
    second = engine.generate(prompts, params)
    for b in range(6):
        row = first.response_ids[b].tolist()
        n = row.index(stop) + 1 if stop in row else len(row)
        assert second.response_mask[b].sum() == n and bool(second.truncated[b]) == (stop not in row)
        assert second.response_ids[b, :n].tolist() == row[:n]
        assert (second.sampling_logprobs[b, n:] == 0).all()


def test_evaluate_scores_every_held_out_prompt_once(tiny_model_path, tokenizer):
    """evaluate(): 5 prompts in generate calls of 2, 3 samples each; the score of a sample is its prompt's number, so
    the mean must be (0+1+2+3+4)/5 = 2 exactly; the response length is the mean of the masks; the RNG is restored."""
    from accelerate import Accelerator

    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import Prompts, Scores, evaluate

    engine = HFGenerateBackend(load_causal_lm(tiny_model_path).eval(), tokenizer, "cpu", torch.float32)
    prompts = [[5, 6, 7 + i] for i in range(5)]
    lengths = []

    def score(raw, ro):
        lengths.append(ro.response_mask.sum(-1))
        return Scores(torch.tensor(raw, dtype=torch.float32))

    state = torch.get_rng_state()
    def generate(idx, params):
        return engine.generate([prompts[i] for i in idx], params)

    out = evaluate(Accelerator(cpu=True), generate, Prompts(list(range(5)), prompts),
                   SamplingParams(max_new_tokens=6, n=3), score, batch_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert out["eval/reward_mean"] == 2.0
    assert out["eval/response_length"] == pytest.approx(float(torch.cat(lengths).float().mean()))


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
    logged metrics of steps 3-4 (which depend on the critic, both optimizers, the KL controller and the RNG)."""
    from test_rewards import build_reward_model

    rm_dir = build_reward_model(str(tmp_path / "rm"))

    def zero3(out, *extra):
        return launch_cmd("zero3.yaml", 2, "ppo.py", [
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
