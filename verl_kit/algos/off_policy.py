"""Off-policy correction for samples drawn by the rollout engine, as pure tensor functions on the scored response
tokens of a micro-batch, flattened to (M,), with `seq_index (M,)` naming each token's sequence (0 <= i < num_seqs).

Why. The responses are sampled by the engine (vLLM), whose distribution mu is not the trainer's pi_old even at the
same weights: other kernels, bf16 logits, fused sampling. In one-step-off-policy mode the engine also ran with the
weights of one optimizer step before the trainer's, so mu is stale as well. PPO's ratio pi / pi_old is taken against
the trainer's recomputed `old_logprobs`, which assumes the tokens came from pi_old; the importance weight
w = pi_old / mu = exp(old_logprobs - sampling_logprobs) corrects for where they really came from (Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training": truncated IS). Both sources of mismatch are
in the one ratio, so the same weight handles equal or one-step-newer trainer weights. Both log-probs must be of the
distribution actually sampled, after temperature: vLLM with `logprobs_mode="processed_logprobs"` (TRL refuses a
server without it), the trainer's logits divided by the same temperature.

How it is applied. The weight is a constant (detached): the per-token policy-gradient loss is multiplied by it,
`clipped_surrogate(logprobs, logprobs - old_logprobs, adv, clip).loss * w`, before the KL penalty is added (the KL
term is not weighted) and before the token reduction (algos.reduction.loss_weights). This is TRL 1.16 GRPOTrainer's
order.

The modes are TRL's `vllm_importance_sampling_mode`, with its bounds `vllm_importance_sampling_clip_max` (C_max,
default 3.0) and `vllm_importance_sampling_clip_min` (C_min, default None):
  token_truncate      w_t = clamp(exp(d_t), C_min, C_max)                          one weight per token
  token_mask          w_t = exp(d_t), or 0 where it is outside [C_min, C_max]
  sequence_truncate   w_i = clamp(exp(sum_t d_t), C_min, C_max)                    one weight per sequence, on all
  sequence_mask       w_i = exp(sum_t d_t), or 0 where it is outside [C_min, C_max]    of its tokens (TRL's default)
with d_t = old_logprobs_t - sampling_logprobs_t. A sequence's ratio is the product of its token ratios (the exp of
the summed log-ratio, not a geometric mean), so every token of a sequence must be in the same call. The bounds are
inclusive: a ratio equal to C_max is kept as it is. A token the engine could not score (sampling log-prob NaN) has
d_t = 0, i.e. no correction, as in TRL 1.16 (GRPOTrainer._generate_and_score_completions: `nan_to_num(diff, nan=0.0)`,
"their importance ratio is exactly 1").
"""

from __future__ import annotations

import torch

from verl_kit.algos.advantages import kl_estimate

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_args(mode: str, clip_max: float | None, clip_min: float | None) -> None:
    """ValueError naming the flag for a mode or bounds TRL would refuse."""
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode {mode!r}: choose {', '.join(MODES[:-1])} or {MODES[-1]}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
                         f"vllm_importance_sampling_clip_max ({clip_max})")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"vllm_importance_sampling_mode {mode!r} needs vllm_importance_sampling_clip_max or "
                         "vllm_importance_sampling_clip_min")


def _weights(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
             mode: str, clip_max: float | None, clip_min: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, True where the bounds changed it) per token, (M,) each, without gradient. Checks the arguments."""
    check_args(mode, clip_max, clip_min)
    with torch.no_grad():
        dtype = torch.promote_types(old_logprobs.dtype, torch.float32)  # a sum over thousands of tokens: not bf16
        diff = torch.nan_to_num(old_logprobs.to(dtype) - sampling_logprobs.to(dtype), nan=0.0)
        if mode.startswith("sequence"):
            diff = torch.zeros(num_seqs, dtype=dtype, device=diff.device).index_add(0, seq_index, diff)[seq_index]
        ratio = diff.exp()
        outside = torch.zeros_like(ratio, dtype=torch.bool)
        if clip_max is not None:
            outside |= ratio > clip_max
        if clip_min is not None:
            outside |= ratio < clip_min
        if mode.endswith("_truncate"):
            return ratio.clamp(min=clip_min, max=clip_max), outside
        return ratio.masked_fill(outside, 0.0), outside


def importance_weights(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, seq_index: torch.Tensor,
                       num_seqs: int, mode: str = "sequence_mask", clip_max: float | None = 3.0,
                       clip_min: float | None = None) -> torch.Tensor:
    """Importance weight pi_old / mu per token (M,), detached, for `mode` in MODES (see the module docstring).
    old_logprobs (M,): the trainer's; sampling_logprobs (M,): the engine's; seq_index (M,) in [0, num_seqs).
    The defaults are TRL 1.16's. Multiply the per-token policy loss by it."""
    return _weights(old_logprobs, sampling_logprobs, seq_index, num_seqs, mode, clip_max, clip_min)[0]


def mismatch_metrics(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, seq_index: torch.Tensor,
                     num_seqs: int, mode: str = "sequence_mask", clip_max: float | None = 3.0,
                     clip_min: float | None = None) -> dict[str, torch.Tensor]:
    """How far the engine is from the trainer, per token: {name: (M,) detached}, same arguments as
    importance_weights. Every value is per token so that `Tally.add(**metrics)` sums them over micro-batches and
    ranks; a step's metric is then the sum over the denominator below, or the running max / min of the tensor.

      is_tokens           1.0 on every token; the denominator of is_ratio and is_clipped
      mismatch_tokens     1.0 where the engine scored the token (its log-prob is not NaN); the denominator of the
                          next two
      mismatch_kl         k3 estimate of KL(mu || pi_old), mu the engine, from the engine's samples:
                          r - 1 - log r, r = pi_old / mu (Schulman 2020; verl's rollout-correction `k3_kl`).
                          0 where unscored. Sum / sum(mismatch_tokens)
      sampling_logp_diff  |old_logprobs - sampling_logprobs|, 0 where unscored. Sum / sum(mismatch_tokens) is TRL's
                          sampling/sampling_logp_difference/mean, its max over the step .../max
      is_ratio            the weight applied (as importance_weights), 1 where unscored. Sum / sum(is_tokens) is the
                          token mean;
                          its min and max are TRL's sampling/importance_sampling_ratio/min and /max. TRL's /mean
                          is this token mean in token_* modes, but a mean over sequences in sequence_* modes
      is_clipped          1.0 where the bounds changed the weight (truncated or masked). Sum / sum(is_tokens):
                          the fraction of tokens corrected (in sequence_* modes, the tokens of such sequences)

    Compute it once per rollout batch, not once per PPO epoch, to count every token once (TRL logs it at
    generation time)."""
    weights, outside = _weights(old_logprobs, sampling_logprobs, seq_index, num_seqs, mode, clip_max, clip_min)
    with torch.no_grad():
        old, sampling = old_logprobs.to(weights.dtype), sampling_logprobs.to(weights.dtype)
        scored = ~torch.isnan(sampling)
        sampling = torch.where(scored, sampling, old)  # an unscored token reads as agreement: 0 below
        return {
            "is_tokens": torch.ones_like(weights),
            "mismatch_tokens": scored.to(weights.dtype),
            "mismatch_kl": kl_estimate(sampling, old, "k3"),
            "sampling_logp_diff": (old - sampling).abs(),
            "is_ratio": weights,
            "is_clipped": outside.to(weights.dtype),
        }


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A step's off-policy metrics from the summed mismatch_metrics (a reduced Tally); {} when none were added."""
    if not sums.get("is_tokens"):
        return {}
    n, scored = sums["is_tokens"], max(sums["mismatch_tokens"], 1.0)  # every token; those the engine scored
    return {"rollout/mismatch_kl": sums["mismatch_kl"] / scored,
            "rollout/logp_diff_mean": sums["sampling_logp_diff"] / scored,
            "rollout/is_ratio_mean": sums["is_ratio"] / n, "rollout/is_clipped_frac": sums["is_clipped"] / n}
