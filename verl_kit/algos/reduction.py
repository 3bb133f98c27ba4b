"""Loss reductions over a whole step: every recipe turns its per-token or per-example losses into one micro-batch's
share of a mean over all micro-batches on all ranks, with `global_mean_share`, so that the gradient does not depend on
how the step was split across ranks and micro-batches (tested against one process in tests/train/test_engine.py)."""

from __future__ import annotations

import torch


def global_mean_share(per_item: torch.Tensor, total: float, world_size: int) -> torch.Tensor:
    """This micro-batch's part of the mean over all `total` items of the step: sum(per_item) * world / total, a
    scalar. Summed over micro-batches it is the rank's share; DDP and DeepSpeed then *average* gradients over ranks,
    which the factor `world` undoes, so the applied gradient is that of (sum over all items) / total. Items are
    tokens (SFT, PPO), examples or pairs (DPO, KTO, reward model), or pre-weighted tokens with total 1 (GRPO's
    loss_weights)."""
    return per_item.sum() * world_size / total


def loss_weights(loss_type: str, row_lengths: torch.Tensor, global_tokens: float, global_seqs: float,
                 max_len: int) -> torch.Tensor:
    """Per-token weights (M,) that reduce a per-token loss over a minibatch on all ranks, as
    global_mean_share(per_token * weights, 1.0, world). `row_lengths` (M,): the length of each token's response.
      dapo      1 / N_tokens                    every token counts the same (DAPO; verl's token-mean)
      grpo      1 / (len_i * N_seqs)            each response's token mean, then the mean over responses (GRPO paper)
      dr_grpo   1 / (N_seqs * max_len)          a constant normaliser, no length bias (Liu et al. 2025)
      cispo     1 / N_tokens                    as dapo (TRL normalises its CISPO loss so)
    The names are TRL's (GRPOConfig.loss_type). Over a minibatch the weights sum to 1 for dapo and grpo, and to
    N_tokens / (N_seqs * max_len) for dr_grpo."""
    if loss_type in ("dapo", "cispo"):
        return torch.full_like(row_lengths, 1.0 / global_tokens, dtype=torch.float32)
    if loss_type == "grpo":
        return 1.0 / (row_lengths.float() * global_seqs)
    if loss_type == "dr_grpo":
        return torch.full_like(row_lengths, 1.0 / (global_seqs * max_len), dtype=torch.float32)
    raise ValueError(f"loss_type {loss_type!r}: choose dapo, grpo, dr_grpo or cispo")
