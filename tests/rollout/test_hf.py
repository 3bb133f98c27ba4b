"""The HF-generate rollout backend (verl_kit.rollout.hf): its sampling log-probs are the model's at the sampling
temperature (also as the recipes compute them, packed or padded), and an EOS cuts each response where it first occurs;
the held-out evaluation (verl_kit.rollout.prompts.evaluate) scores every prompt once."""

import types

import pytest
import torch

from verl_kit.data import logprobs_from_logits
from verl_kit.rollout import HFGenerateBackend, SamplingParams
from verl_kit.train import actor_logits, pack_responses


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


def test_generating_on_the_trained_model_itself(tiny_model_path, tokenizer):
    """shares_policy (one process, no sharding, no LoRA, fp32, no --async_rollout): the backend generates on the
    trained model, gradient-checkpointed and in training mode as a recipe holds it, and gives the tokens and
    log-probs a copy gives from the same RNG state; the model is back in training mode after, a sync copies
    nothing, and an update of the model is what the next generation samples from."""
    from verl_kit.models import load_causal_lm
    from verl_kit.rollout.hf import shares_policy

    assert shares_policy(True, False, False, False)
    assert not any([shares_policy(False, False, False, False), shares_policy(True, True, False, False),
                    shares_policy(True, False, True, False), shares_policy(True, False, False, True)])
    actor = load_causal_lm(tiny_model_path, gradient_checkpointing=True).train()
    prompts = [tokenizer("<|user|>Describe the sea.<|end|><|assistant|>")["input_ids"], [5, 6, 7]]
    params = SamplingParams(temperature=0.7, max_new_tokens=12, n=3)
    copy = HFGenerateBackend(actor, tokenizer, "cpu", torch.float32)
    shared = HFGenerateBackend(actor, tokenizer, "cpu", torch.float32, share=True)
    assert shared.model is actor and copy.model is not actor
    got = {}
    for name, engine in (("copy", copy), ("shared", shared)):
        torch.manual_seed(1)
        got[name] = engine.generate(prompts, params)
    assert actor.training and torch.equal(got["copy"].response_ids, got["shared"].response_ids)
    torch.testing.assert_close(got["copy"].sampling_logprobs, got["shared"].sampling_logprobs)
    assert shared.load_weights(actor, version=1)["sync/version"] == 1
    with torch.no_grad():
        actor.lm_head.weight.mul_(-1)  # an update: the next generation samples from it, with no sync
    torch.manual_seed(1)
    assert not torch.equal(shared.generate(prompts, params).response_ids, got["shared"].response_ids)


def test_evaluate_scores_every_held_out_prompt_once(tiny_model_path, tokenizer):
    """evaluate(): 5 prompts in generate calls of 2, 3 samples each; the score of a sample is its prompt's number, so
    the mean must be (0+1+2+3+4)/5 = 2 exactly; the response length is the mean of the masks; the RNG is restored."""
    from accelerate import Accelerator

    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import Prompts, Scores, evaluate

    engine = HFGenerateBackend(load_causal_lm(tiny_model_path).eval(), tokenizer, "cpu", torch.float32)
    prompts = [[5, 6, 7 + i] for i in range(5)]
    lengths = []

    def score(ro):
        lengths.append(ro.response_mask.sum(-1))
        return Scores(torch.tensor(ro.rows, dtype=torch.float32))

    state = torch.get_rng_state()
    split = Prompts(list(range(5)), prompts)  # the "dataset row" of prompt i is its number

    def generate(idx, params):  # as rollout.Rollouts: the batch carries its dataset rows
        return engine.generate([prompts[i] for i in idx], params).with_prompts(Prompts.each(idx, params.n), split.rows)

    out = evaluate(Accelerator(cpu=True), generate, split,
                   SamplingParams(max_new_tokens=6, n=3), score, batch_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert out["eval/reward_mean"] == 2.0
    assert out["eval/response_length"] == pytest.approx(float(torch.cat(lengths).float().mean()))
