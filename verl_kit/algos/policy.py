"""PPO losses as pure tensor functions on the scored response tokens of a micro-batch, flattened to (M,).

Every loss is returned per token; the reduction is the caller's and is explicit (algos.reduction).
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
