"""PPO losses as pure tensor functions on the scored response tokens of a micro-batch, flattened to (M,).

Every loss is returned per token; the reduction is the caller's and is explicit (algos.reduction).

The policy-loss variants of the online recipes (docs/algorithms.md), all on the log-ratio log pi - log pi_old:
  clipped_surrogate   PPO's clipped surrogate; with clip_high > clip the range is asymmetric (DAPO's clip-higher)
  sequence_log_ratio  GSPO's sequence-level ratio, the mean log-ratio of a response on each of its tokens
  cispo_loss          CISPO: the clipped ratio as a detached weight of the log-probability, no token is cut
`seq_index (M,)` names each token's response (0 <= i < num_seqs): every token of a response must be in the same call
(train.ResponsePacker packs whole responses, so one micro-batch holds them all).
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum_v p_v z_v. (M, V) -> (M,)."""
    logits = logits.float()
    return logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
                      clip_high: float | None = None) -> torch.Tensor:
    """Clipped surrogate (Schulman et al. 2017, eq. 7), negated for descent, per token (M,):
    max(-A * r, -A * clip(r, 1 - clip, 1 + clip_high)), r = exp(log_ratio). clip_high None: clip (symmetric);
    clip_high > clip: DAPO's clip-higher (Yu et al. 2025), more room to raise unlikely tokens.
    TRL's `epsilon` and `epsilon_high`; verl's clip_ratio_low and clip_ratio_high."""
    ratio = torch.exp(log_ratio)
    high = clip if clip_high is None else clip_high
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip, 1.0 + high))


def clipped_tokens(log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
                   clip_high: float | None = None) -> torch.Tensor:
    """1.0 where the clipped branch of clipped_surrogate is the active one (the token's gradient is cut), else 0.0:
    r > 1 + clip_high with A > 0, or r < 1 - clip with A < 0 (TRL's clip_ratio/region_mean). (M,)"""
    ratio = torch.exp(log_ratio)
    high = clip if clip_high is None else clip_high
    return (-advantages * ratio.clamp(1.0 - clip, 1.0 + high) > -advantages * ratio).float()


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, seq_index: torch.Tensor,
                       num_seqs: int) -> torch.Tensor:
    """GSPO's log-ratio (Zheng et al. 2025): log s_i = (1/|y_i|) sum_t (log pi - log pi_old)_{i,t}, the
    length-normalised log of the sequence likelihood ratio, put on every token of response i. (M,) -> (M,).

    The gradient flows through the mean, as in TRL 1.16 (GRPOTrainer._compute_loss, importance_sampling_level
    "sequence"): d log s_i / d log pi_{i,t} = 1 / |y_i| for each of its tokens. verl writes the same ratio as
    sg[log s_i] + log pi_t - sg[log pi_t] per token; both give the same values, and the same gradient whenever the
    per-token loss weights are equal within a response (all of loss_weights' reductions are; a token-level
    importance weight from off_policy is not)."""
    diff = logprobs - old_logprobs
    sums = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add(0, seq_index, diff)
    counts = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add(0, seq_index,
                                                                                    torch.ones_like(diff))
    return (sums / counts.clamp(min=1.0))[seq_index]


def cispo_loss(logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor,
               cap: float) -> torch.Tensor:
    """CISPO (MiniMax 2025, "MiniMax-M1"), negated for descent, per token (M,): -sg[min(r, cap)] * A * log pi,
    r = exp(log_ratio). The importance weight is clipped and detached instead of the update: every token keeps a
    gradient A * min(r, cap) * grad log pi, however far its ratio moved. The form and the one bound are TRL 1.16's
    (loss_type "cispo": clamp(ratio, max=epsilon_high), ScaleRL's eps_max, recommended 5.0)."""
    weight = torch.exp(log_ratio).clamp(max=cap).detach()
    return -weight * advantages * logprobs


def cispo_clipped(log_ratio: torch.Tensor, advantages: torch.Tensor, cap: float) -> torch.Tensor:
    """1.0 where cispo_loss capped the weight of a token with A > 0 (r > cap), else 0.0; TRL's cispo_clip_ratio.
    (M,)"""
    return ((torch.exp(log_ratio) > cap) & (advantages > 0)).float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Clipped value loss per token (M,): 0.5 * max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clip(V - V_old,
    -eps, eps) (the PPO2 baselines form; Huang et al. 2022, "The 37 implementation details of PPO", detail 9)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def value_clipped(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """1.0 where the clipped branch of value_loss is strictly larger, else 0.0. (M,)"""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return ((clipped - returns) ** 2 > (values - returns) ** 2).float()
