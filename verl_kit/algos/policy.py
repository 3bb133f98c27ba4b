"""PPO losses as pure tensor functions on the scored response tokens of a micro-batch, flattened to (M,).

Every loss is returned per token; the reduction is the caller's and is explicit: `token_mean_share` turns a per-token
loss into this micro-batch's share of the mean over all the tokens of a minibatch on all ranks, so the gradient does
not depend on how the minibatch was split across ranks and micro-batches.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum_v p_v z_v. (M, V) -> (M,)."""
    logits = logits.float()
    return logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                clip: float) -> torch.Tensor:
    """Clipped surrogate (Schulman et al. 2017, eq. 7), negated for descent, per token (M,):
    max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = exp(logprobs - old_logprobs)."""
    ratio = torch.exp(logprobs - old_logprobs)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip, 1.0 + clip))


def policy_clipped(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   clip: float) -> torch.Tensor:
    """1.0 where the clipped branch of policy_loss is the active one (the token's gradient is cut), else 0.0. (M,)"""
    ratio = torch.exp(logprobs - old_logprobs)
    return (-advantages * ratio.clamp(1.0 - clip, 1.0 + clip) > -advantages * ratio).float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Clipped value loss per token (M,): 0.5 * max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clip(V - V_old,
    -eps, eps) (the PPO2 baselines form; Huang et al. 2022, "The 37 implementation details of PPO", detail 9)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def value_clipped(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """1.0 where the clipped branch of value_loss is strictly larger, else 0.0. (M,)"""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return ((clipped - returns) ** 2 > (values - returns) ** 2).float()


def token_mean_share(per_token: torch.Tensor, global_tokens: float, world_size: int) -> torch.Tensor:
    """This micro-batch's part of the token mean over the whole minibatch: sum(per_token) * world / N_global.
    Summed over micro-batches it is the rank's share; DDP and DeepSpeed then *average* gradients over ranks, which
    the factor `world` undoes, so the applied gradient is that of sum over all tokens / N_global. A scalar."""
    return per_token.sum() * world_size / global_tokens


def loss_weights(loss_type: str, row_lengths: torch.Tensor, global_tokens: float, global_seqs: float,
                 max_len: int) -> torch.Tensor:
    """Per-token weights (M,) that reduce a per-token loss over a minibatch on all ranks (then summed, times
    world_size, as in token_mean_share). `row_lengths` (M,): the length of each token's response.
      dapo      1 / N_tokens                    every token counts the same (DAPO; verl's token-mean)
      grpo      1 / (len_i * N_seqs)            each response's token mean, then the mean over responses (GRPO paper)
      dr_grpo   1 / (N_seqs * max_len)          a constant normaliser, no length bias (Liu et al. 2025)
    The names are TRL's (GRPOConfig.loss_type). Over a minibatch the weights sum to 1 for dapo and grpo, and to
    N_tokens / (N_seqs * max_len) for dr_grpo."""
    if loss_type == "dapo":
        return torch.full_like(row_lengths, 1.0 / global_tokens, dtype=torch.float32)
    if loss_type == "grpo":
        return 1.0 / (row_lengths.float() * global_seqs)
    if loss_type == "dr_grpo":
        return torch.full_like(row_lengths, 1.0 / (global_seqs * max_len), dtype=torch.float32)
    raise ValueError(f"loss_type {loss_type!r}: choose dapo, grpo or dr_grpo")
