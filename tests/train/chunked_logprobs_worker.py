"""Run by tests/train/test_chunked_logprobs_zero3.py, alone or under `accelerate launch`: one micro-batch per process
of a fixed GRPO-like rollout (groups of 4 responses sharing a prompt, packed), log-probs and entropy of its response
tokens through the chunked LM head (`chunked`) or the whole logits (`full`), the gradient of
sum(a * logp + b * entropy) over every process's tokens, and records each token's values, the global gradient norm
and the full (gathered) gradient of the output layer and of the input embedding."""

import json
import sys

import torch

from verl_kit.config import TrainConfig
from verl_kit.models import load_causal_lm
from verl_kit.train import (
    DeepSpeed,
    Trainable,
    actor_logits,
    chunkable,
    destroy,
    full_logprobs,
    head_logprobs,
    make_accelerator,
    pack_responses,
)


def rollout():
    """8 responses of up to 11 tokens in 2 groups of 4, each group sharing its prompt."""
    g = torch.Generator().manual_seed(7)
    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10, 11]] * 4
    response = torch.randint(5, 600, (8, 11), generator=g)
    mask = torch.arange(11)[None] < torch.randint(3, 12, (8,), generator=g)[:, None]
    a, b = torch.randn(8, 11, generator=g), torch.randn(8, 11, generator=g)
    return prompts, response, mask, a, b


def full_grad(param, deepspeed: bool) -> torch.Tensor:
    if deepspeed:
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    return param.grad


def main(model_path: str, out: str, mode: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=4, max_grad_norm=1e9,
                      gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    policy = Trainable(accelerator, load_causal_lm(model_path), cfg, learning_rate=1e-3, total_steps=1)
    prompts, response, mask, a, b = rollout()
    rows = list(range(rank, 8, world))
    batch, ix = pack_responses(prompts, response, mask, rows, 0, True, 128, True)
    batch = batch.to(device)
    for _ in policy.accumulate([rows]):
        if mode == "chunked":
            lp, ent = head_logprobs(policy.model, batch.inputs(), ix.scored, ix.targets, 0.7, chunk_size=100)
        else:
            lp, ent = full_logprobs(actor_logits(policy.model, batch, ix, 0.7), ix.targets)
        # the sum over all processes' tokens: each process's share times world, averaged over processes
        policy.backward((ix.gather(a) * lp + ix.gather(b) * ent).sum() * world)
    inner = accelerator.unwrap_model(policy.model)
    grads = {name: full_grad(p, isinstance(policy.sharding, DeepSpeed)) for name, p in
             (("lm_head", inner.lm_head.weight), ("embed", inner.get_input_embeddings().weight))}
    grad_norm = policy.step()
    result = {"world": world, "rank": rank, "grad_norm": grad_norm, "chunkable": chunkable(policy.model),
              "tokens": [[int(r), int(p), float(x), float(y)] for r, p, x, y in zip(ix.row, ix.pos, lp, ent)]}
    if rank == 0:
        torch.save(grads, out + ".grads.pt")
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
