"""Run by tests/train/test_vocab_memory.py in a process of its own, so that its peak resident memory can be read:
two GRPO updates as grpo.py makes them (old log-probs without gradient, then the policy's log-probs and entropy,
the clipped surrogate, backward and an AdamW step), on one group of `responses` random responses of `length` tokens
sharing a prompt of `prompt_length` tokens, through the chunked LM head (`chunked`) or the whole logits (`full`, the
path before verl_kit/train/lm_head.py). Writes the updates' entropies and losses as JSON."""

import json
import sys

import torch

from verl_kit import algos
from verl_kit.config import TrainConfig
from verl_kit.models import load_causal_lm
from verl_kit.train import (
    Trainable,
    actor_logits,
    destroy,
    full_logprobs,
    head_logprobs,
    make_accelerator,
    pack_responses,
)


def main(model_path: str, out: str, responses: int, prompt_length: int, length: int, mode: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=responses, gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    model = load_causal_lm(model_path)
    vocab = model.config.vocab_size
    policy = Trainable(accelerator, model, cfg, learning_rate=1e-3, total_steps=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (prompt_length,), generator=g).tolist()] * responses
    rows, steps = list(range(responses)), []
    for _ in range(2):
        response = torch.randint(5, vocab, (responses, length), generator=g)
        mask = torch.ones(responses, length, dtype=torch.bool)
        adv = algos.group_advantages(torch.randn(responses, generator=g), responses)
        batch, ix = pack_responses(prompts, response, mask, rows, 0, True, prompt_length + length, True)

        def scores(batch=batch, ix=ix):
            if mode == "chunked":
                return head_logprobs(policy.model, batch.inputs(), ix.scored, ix.targets, 1.0)
            return full_logprobs(actor_logits(policy.model, batch, ix, 1.0), ix.targets)

        with torch.no_grad():
            old = scores()[0]
        for _ in policy.accumulate([rows]):
            logprobs, entropy = scores()
            loss = algos.clipped_surrogate(logprobs, logprobs - old, ix.gather(adv), 0.2).loss.mean()
            policy.backward(loss)
        policy.step()
        steps.append({"loss": float(loss), "entropy": float(entropy.mean()), "tokens": len(ix.targets)})
    with open(out, "w") as f:
        json.dump({"vocab": vocab, "steps": steps}, f)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
