"""Scoring examples with a model: per-sequence completion log-probs for many examples at once, sharded over ranks
and gathered back in order. Used for reference log-probs (computed once, before the first update) and evaluation."""

from __future__ import annotations

import torch

from verl_kit.config import BatchConfig
from verl_kit.data.packing import TokenBatch, layout
from verl_kit.metrics import progress
from verl_kit.train.distributed import all_gather, shard, unshard
from verl_kit.train.lm_head import sequence_logprobs

Sequences = tuple[list[list[int]], list[list[bool]]]  # token ids and loss masks of an example's k sequences


def completion_sequences(prompt: list[int], completions: list[list[int]]) -> Sequences:
    """prompt + each completion, with only the completion tokens scored."""
    seqs = [prompt + c for c in completions]
    masks = [[False] * len(prompt) + [True] * len(c) for c in completions]
    return seqs, masks


def make_batch(items: list[Sequences], cfg: BatchConfig, pad_id: int, block_mask: bool) -> TokenBatch:
    """Flatten the items' sequences (item-major) into one packed or padded TokenBatch."""
    seqs = [s for item in items for s in item[0]]
    masks = [m for item in items for m in item[1]]
    return layout(seqs, masks, pad_id, packing=cfg.packing, packing_length=cfg.packing_length, block_mask=block_mask)


def score_subset(accelerator, model, items: list[Sequences], needed: list[int], cfg: BatchConfig, pad_id: int,
                 block_mask: bool, desc: str) -> torch.Tensor:
    """score_items on items[needed] only, scattered back: (n_items, k), NaN for the items not scored."""
    scored = score_items(accelerator, model, [items[i] for i in needed], cfg, pad_id, block_mask, desc)
    out = torch.full((len(items), scored.shape[1]), float("nan"), dtype=scored.dtype)
    out[needed] = scored
    return out


@torch.no_grad()
def score_items(accelerator, model, items: list[Sequences], cfg: BatchConfig, pad_id: int, block_mask: bool,
                desc: str = "scoring", score_batch=None) -> torch.Tensor:
    """A score per sequence of every item: (n_items, k), on CPU, identical on all ranks. The score is
    `score_batch(model, batch) -> (N,)`, by default the summed completion log-probs. Every rank scores ceil(n/world)
    items in the same number of forward passes (ZeRO-3 needs lockstep); progress is shown as `desc`."""
    score_batch = score_batch or sequence_logprobs
    was_training = model.training
    model.eval()
    mine = shard(len(items), accelerator.process_index, accelerator.num_processes)
    k = len(items[0][0])
    out = []
    starts = range(0, len(mine), cfg.per_device_eval_batch_size)
    for i in progress(starts, desc, len(starts), accelerator.is_main_process):
        chunk = [items[j] for j in mine[i:i + cfg.per_device_eval_batch_size]]
        batch = make_batch(chunk, cfg, pad_id, block_mask).to(accelerator.device)
        out.append(score_batch(model, batch).float().view(len(chunk), k))
    local = torch.cat(out)
    gathered = all_gather(accelerator, local)
    model.train(was_training)
    return unshard(gathered.cpu(), len(items), accelerator.num_processes)
