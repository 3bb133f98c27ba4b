"""From rewards to advantages, as pure tensor functions: KL estimators, the KL penalty folded into per-token rewards,
the KL coefficient controllers, the penalty for truncated responses, GAE, the outcome-reward estimators of the
group-sampling recipes (GRPO, RLOO, REINFORCE++-baseline), and whitening with explicit moments.

Shapes: B responses, R response positions (right-padded); `mask (B, R)` is True on real response tokens.
"""

from __future__ import annotations

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, (B, R) -> (B, R) (Schulman 2020, "Approximating KL").

    k1 = log pi - log ref                      unbiased, can be negative per token
    k3 = (r - 1) - log r, r = ref / pi         unbiased, always >= 0, lower variance
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator {kind!r}: choose k1 or k3")


def truncation_penalty(scores: torch.Tensor, truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """Add `penalty` (e.g. -1.0) to the score of responses cut at max_new_tokens without an EOS. (B,), (B,) -> (B,)."""
    return scores + penalty * truncated.to(scores.dtype)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards (B, R): -kl_coef * kl on every response token, plus the sequence score on its last token
    (Ziegler et al. 2019, eq. 2; Stiennon et al. 2020). scores (B,), kl (B, R), mask (B, R); the mask may have holes
    (a multi-turn episode's environment tokens), the score goes on its last True (column 0 for an empty row)."""
    rewards = -kl_coef * kl * mask
    R = mask.shape[1]
    last = torch.where(mask.any(-1), R - 1 - mask.long().flip(-1).argmax(-1), 0)
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:
    """Generalized advantage estimation (Schulman et al. 2015, eq. 16), (B, R) -> advantages (B, R).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}, with V and A zero past the last
    response token, so the episode ends there. Returns are A + V (the critic's target).
    Positions outside `mask` inside a response (a multi-turn episode's environment tokens) are skipped: t+1 is the
    next masked token, and their values and rewards are ignored (verl's multi-turn GAE); for a mask that is a prefix
    of each row this is plain GAE.
    """
    mask = mask.bool()
    values = values * mask
    rewards = rewards * mask
    R = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a
        next_adv = torch.where(mask[:, t], a, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
    return adv * mask


def group_advantages(scores: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantage of each response (Shao et al. 2024, eq. 3, outcome supervision): its score minus the mean of
    its group (the `group_size` responses to the same prompt, consecutive rows), divided by the group's standard
    deviation (unbiased, + eps) when `scale` (False: Liu et al. 2025, "Dr. GRPO"). scores (B,) -> (B,); a group whose
    scores are all equal gets 0."""
    groups = scores.double().view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    return centred.view(-1).to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's advantage (Kool et al. 2019; Ahmadian et al. 2024): a response's score minus the mean of the *other*
    group_size - 1 scores of its group (consecutive rows), s_i - (sum_j s_j - s_i) / (n - 1) = n / (n - 1) * (s_i -
    mean). Not divided by a standard deviation (verl's `rloo`). scores (B,) -> (B,); needs group_size >= 2."""
    groups = scores.double().view(-1, group_size)
    others = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).view(-1).to(scores.dtype)


def reinforce_plus_plus_baseline_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor,
                                            reduce=lambda moments: moments, episode: torch.Tensor | None = None
                                            ) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++"; verl's `reinforce_plus_plus_baseline`): the score minus
    its group's mean, then whitened over every response token of the whole batch: (c_i - mean) / std with mean and
    (population) variance of c taken over tokens, so a response weighs by its length, as verl's masked_whiten of the
    token-broadcast advantages. scores (B,), mask (B, R) -> (B,), one value per response. `reduce` sums the
    masked_moments over processes (train.reduce_metrics; the identity for one process), so the result does not
    depend on how the batch is split. verl uses the unbiased variance: a factor sqrt(N / (N - 1)) over N tokens.
    `episode` (B,) long: the scores are per episode (E,) and response i belongs to episode episode[i] (an agent's
    per-call samples); None: one response per score."""
    centred = group_advantages(scores, group_size, scale=False)
    centred = centred if episode is None else centred[episode]
    moments = reduce(masked_moments(centred[:, None].expand(mask.shape), mask))
    return whiten(centred, torch.ones_like(centred, dtype=torch.bool), moments)


OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # verl's names (--advantage_estimator)


def outcome_advantages(estimator: str, scores: torch.Tensor, group_size: int, mask: torch.Tensor,
                       episode: torch.Tensor, scale: bool = True, reduce=lambda moments: moments) -> torch.Tensor:
    """The advantage of every response row under `estimator` (OUTCOME_ESTIMATORS): scores (E,), one per episode,
    groups of `group_size` consecutive episodes; `episode` (B,) long: each row's episode (an agent's per-call samples
    share theirs); mask (B, R) -> (B,). `scale`: grpo's division by the group's std; `reduce`: sums moments over
    processes (REINFORCE++-baseline whitens over every process's tokens)."""
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(scores, group_size, mask, reduce, episode)
    if estimator == "rloo":
        return rloo_advantages(scores, group_size)[episode]
    if estimator == "grpo":
        return group_advantages(scores, group_size, scale)[episode]
    raise ValueError(f"advantage estimator {estimator!r}: one of {OUTCOME_ESTIMATORS}")


def masked_moments(x: torch.Tensor, mask: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """{prefix + "count", "sum", "sum_sq"}: count, sum and sum of squares of x over mask (float64). Sum these over
    ranks (distributed.reduce_metrics) before whiten() so that whitening does not depend on how the batch is split."""
    x = x.double()[mask.bool()]
    return {f"{prefix}count": float(x.numel()), f"{prefix}sum": float(x.sum()), f"{prefix}sum_sq": float((x * x).sum())}


def masked_variance(moments: dict[str, float], prefix: str = "") -> float:
    """Population variance from masked_moments (possibly summed over ranks); 0 over no tokens (a step whose every
    episode failed)."""
    n = max(moments[f"{prefix}count"], 1.0)
    mean = moments[f"{prefix}sum"] / n
    return max(moments[f"{prefix}sum_sq"] / n - mean * mean, 0.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: dict[str, float], shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked tokens, with mean and (population) variance taken from `moments`
    (masked_moments, possibly summed over ranks). shift_mean=False keeps the mean (scales only). (B, R) -> (B, R)."""
    mean, var = moments["sum"] / max(moments["count"], 1.0), masked_variance(moments)
    out = (x - mean) / (var + eps) ** 0.5
    if not shift_mean:
        out = out + mean
    return out * mask


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019, section 2.2: e = clip(KL / target - 1, -0.2, 0.2), beta <- beta * (1 + e * n / horizon),
    with KL the mean per-sequence KL of the batch and n the number of sequences it was measured on. Being stateful,
    it is checkpointed (state_dict) so that a resumed run continues with the same beta."""

    def __init__(self, kl_coef: float, target: float, horizon: float):
        super().__init__(kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
