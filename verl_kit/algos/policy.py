"""PPO losses as pure tensor functions on the scored response tokens of a micro-batch, flattened to (M,).

Every loss is returned per token; the reduction is the caller's and is explicit (algos.reduction).

A policy loss is a surrogate, one function with one signature, plus the reduction it is used with, declared together
in POLICY_LOSSES under TRL's names (GRPOConfig.loss_type); a recipe looks its loss up once, before the loop. Adding a
loss is a function here, its entry, its test (tests/algos/test_policy.py) and its line in docs/algorithms.md.
The surrogates, all on the log-ratio log pi - log pi_old (GSPO's sequence_log_ratio gives either one a per-response
ratio):
  clipped_surrogate   PPO's clipped surrogate; with clip_high > clip the range is asymmetric (DAPO's clip-higher)
  cispo               CISPO: the capped ratio as a detached weight of the log-probability, no token is cut
`seq_index (M,)` names each token's response (0 <= i < num_seqs): every token of a response must be in the same call
(train.ResponsePacker packs whole responses, so one micro-batch holds them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Surrogate(NamedTuple):
    """A per-token loss and where it was clipped, both (M,): `loss` carries the gradient; `clipped` is 1.0 on the
    tokens whose clip (or cap) was active, else 0.0, float and without gradient (the recipes' clipfrac metrics)."""

    loss: torch.Tensor
    clipped: torch.Tensor


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum_v p_v z_v. (M, V) -> (M,)."""
    logits = logits.float()
    return logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)


def clipped_surrogate(logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
                      clip_high: float | None = None) -> Surrogate:
    """Clipped surrogate (Schulman et al. 2017, eq. 7), negated for descent, per token (M,):
    max(-A * r, -A * clip(r, 1 - clip, 1 + clip_high)), r = exp(log_ratio). clip_high None: clip (symmetric);
    clip_high > clip: DAPO's clip-higher (Yu et al. 2025), more room to raise unlikely tokens.
    TRL's `epsilon` and `epsilon_high`; verl's clip_ratio_low and clip_ratio_high.
    `clipped`: the clipped branch is strictly the larger, so the token's gradient is cut: r > 1 + clip_high with
    A > 0, or r < 1 - clip with A < 0 (TRL's clip_ratio/region_mean). `logprobs` (M,) is not used: it is there so
    that every surrogate of POLICY_LOSSES is called the same way."""
    ratio = torch.exp(log_ratio)
    high = clip if clip_high is None else clip_high
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1.0 - clip, 1.0 + high)
    return Surrogate(torch.maximum(unclipped, clipped), (clipped > unclipped).float())


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


def cispo(logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
          clip_high: float | None = None) -> Surrogate:
    """CISPO (MiniMax 2025, "MiniMax-M1"), negated for descent, per token (M,): -sg[min(r, cap)] * A * log pi,
    r = exp(log_ratio), cap = clip_high. The importance weight is clipped and detached instead of the update: every
    token keeps a gradient A * min(r, cap) * grad log pi, however far its ratio moved. The form and the one bound are
    TRL 1.16's (loss_type "cispo": clamp(ratio, max=epsilon_high), ScaleRL's eps_max, recommended 5.0), so `clip`
    is not used. `clipped`: r > cap with A > 0, the tokens whose weight the cap lowered (TRL's cispo_clip_ratio)."""
    if clip_high is None:
        raise ValueError("cispo needs clip_high, the cap on the ratio (TRL's epsilon_high)")
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=clip_high).detach()
    return Surrogate(-weight * advantages * logprobs, ((ratio > clip_high) & (advantages > 0)).float())


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: its surrogate (logprobs, log_ratio, advantages, clip, clip_high) -> Surrogate, all (M,), and
    the reduction it is used with, one of algos.reduction.REDUCTIONS (the first argument of loss_weights).

    POLICY_LOSSES, under TRL's GRPOConfig.loss_type names, each with TRL's reduction for that name. Over a minibatch
    of N_seqs responses holding N_tokens tokens, the loss of a token of response i (len_i tokens) weighs:
      dapo     clipped_surrogate  token     1 / N_tokens           every token the same (Yu et al. 2025)
      grpo     clipped_surrogate  sequence  1 / (len_i * N_seqs)   mean of response token means (Shao et al. 2024)
      dr_grpo  clipped_surrogate  constant  1 / (N_seqs * max_len) no length bias (Liu et al. 2025, "Dr. GRPO")
      cispo    cispo              token     1 / N_tokens           as dapo (TRL normalises its CISPO loss so)
    """

    surrogate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float | None], Surrogate]
    reduction: str


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "dapo": PolicyLoss(clipped_surrogate, "token"),
    "grpo": PolicyLoss(clipped_surrogate, "sequence"),
    "dr_grpo": PolicyLoss(clipped_surrogate, "constant"),
    "cispo": PolicyLoss(cispo, "token"),
}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> Surrogate:
    """Clipped value loss per token (M,): 0.5 * max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clip(V - V_old,
    -eps, eps) (the PPO2 baselines form; Huang et al. 2022, "The 37 implementation details of PPO", detail 9).
    `clipped`: the clipped branch is strictly the larger (equal branches do not count)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return Surrogate(0.5 * torch.maximum(unclipped_sq, clipped_sq), (clipped_sq > unclipped_sq).float())
