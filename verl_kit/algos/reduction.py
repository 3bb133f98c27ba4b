"""Loss reductions over a whole step: every recipe turns its per-token or per-example losses into one micro-batch's
share of a mean over all micro-batches on all ranks, with `global_mean_share`, so that the gradient does not depend on
how the step was split across ranks and micro-batches (tested against one process in tests/train/test_engine.py).
Which reduction a policy loss uses is declared beside the loss (algos.policy.POLICY_LOSSES), not here."""

from __future__ import annotations

import torch

REDUCTIONS = ("token", "sequence", "constant")


def global_mean_share(per_item: torch.Tensor, total: float, world_size: int) -> torch.Tensor:
    """This micro-batch's part of the mean over all `total` items of the step: sum(per_item) * world / total, a
    scalar. Summed over micro-batches it is the rank's share; DDP and DeepSpeed then *average* gradients over ranks,
    which the factor `world` undoes, so the applied gradient is that of (sum over all items) / total. Items are
    tokens (SFT, PPO), examples or pairs (DPO, KTO, reward model), or pre-weighted tokens with total 1
    (loss_weights)."""
    return per_item.sum() * world_size / total


def loss_weights(reduction: str, row_lengths: torch.Tensor, global_tokens: float, global_seqs: float,
                 max_len: int) -> torch.Tensor:
    """Per-token weights (M,) that reduce a per-token loss over a minibatch on all ranks, as
    global_mean_share(per_token * weights, 1.0, world). `row_lengths` (M,): the length of each token's response;
    `global_tokens`, `global_seqs`: the minibatch's tokens and responses on all ranks; `max_len`: the longest a
    response may be.
      token      1 / N_tokens             every token counts the same (Yu et al. 2025; verl's token-mean)
      sequence   1 / (len_i * N_seqs)     each response's token mean, then the mean over responses (Shao et al. 2024)
      constant   1 / (N_seqs * max_len)   a constant normaliser, no length bias (Liu et al. 2025)
    Over a minibatch the weights sum to 1 for token and sequence, and to N_tokens / (N_seqs * max_len) for
    constant."""
    if reduction == "token":
        return torch.full_like(row_lengths, 1.0 / global_tokens, dtype=torch.float32)
    if reduction == "sequence":
        return 1.0 / (row_lengths.float() * global_seqs)
    if reduction == "constant":
        return torch.full_like(row_lengths, 1.0 / (global_seqs * max_len), dtype=torch.float32)
    raise ValueError(f"reduction {reduction!r}: choose one of {', '.join(REDUCTIONS)}")
