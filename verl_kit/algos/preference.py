"""Preference losses as pure tensor functions. The DPO family and KTO take per-sequence log-probabilities summed over
completion tokens (with the completions' lengths where a loss averages per token); Bradley-Terry takes the reward
model's scalar rewards. Outputs are per-example losses, so the caller chooses and states the reduction."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sigmoid_norm", "sft", "simpo", "orpo")
# the loss types that read no reference log-probs: a run of only these loads and scores no reference
REFERENCE_FREE_LOSS_TYPES = ("sft", "simpo", "orpo")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the loss types built on the chosen - rejected difference h, which an f-divergence's f'(pi/ref) may replace
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def f_divergence_score(log_ratio: torch.Tensor, f_divergence_type: str = "reverse_kl",
                       alpha: float = 0.5) -> torch.Tensor:
    """f'(u) of the f-DPO paper (Wang et al. 2023) at u = pi/ref = exp(log_ratio), elementwise; it stands for the
    log-ratio in DPO's difference h. reverse_kl: log u (DPO itself); forward_kl: 1 - 1/u; js_divergence:
    log(2u / (1 + u)) = log 2 + log sigma(log u); alpha_divergence: (u^(alpha-1) - 1) / (alpha - 1), log u at
    alpha = 1 (TRL's f_alpha_divergence_coef; its exponent capped at 80, as TRL's in fp32)."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1) < 1e-6):
        return log_ratio
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if f_divergence_type == "alpha_divergence":
        return (torch.exp(((alpha - 1) * log_ratio).clamp(max=80.0)) - 1) / (alpha - 1)
    raise ValueError(f"--f_divergence_type: unknown value {f_divergence_type!r}; choose from: "
                     f"{', '.join(F_DIVERGENCES)}")


def dpo_loss_terms(loss_type: str, loss_weights: str | None = None, label_smoothing: float = 0.0,
                   discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl") -> list[tuple[str, float]]:
    """TRL's `loss_type` and `loss_weights` as the recipe's flags give them (comma-separated strings) -> the
    (loss type, weight) pairs whose weighted sum is the loss, after checking every value that goes with them: a
    ValueError that starts with the flag's name otherwise."""
    types = [t.strip() for t in loss_type.split(",")]
    for t in types:
        if t not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type: {t!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    try:
        weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in str(loss_weights).split(",")]
    except ValueError:
        raise ValueError(f"loss_weights {loss_weights!r}: expected comma-separated numbers") from None
    if len(weights) != len(types):
        raise ValueError(f"loss_weights {loss_weights}: {len(weights)} weight(s) for {len(types)} loss type(s) "
                         f"({loss_type})")
    eps = label_smoothing
    if eps and not {"sigmoid", "robust", "exo_pair", "simpo"} & set(types):
        raise ValueError(f"label_smoothing {eps}: only sigmoid, robust, exo_pair and simpo use it, not {loss_type}")
    if not 0 <= eps < 1 or ("robust" in types and eps >= 0.5) or ("exo_pair" in types and eps <= 0):
        raise ValueError(f"label_smoothing {eps}: use [0, 1) (robust: [0, 0.5); exo_pair: (0, 1))")
    if discopop_tau <= 0:
        raise ValueError(f"discopop_tau {discopop_tau}: use > 0")
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type: {f_divergence_type!r} is not one of {', '.join(F_DIVERGENCES)}")
    if f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(f"f_divergence_type {f_divergence_type} applies to --loss_type "
                         f"{', '.join(F_DIVERGENCE_LOSS_TYPES)}, not {loss_type}")
    return list(zip(types, weights))


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None,
             discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0) -> torch.Tensor:
    """Per-pair loss of the DPO family, shape (B,), under TRL 1.16's `DPOConfig.loss_type` names and formulas.

    Inputs are log-probs summed over each completion's tokens, (B,); `chosen_lengths`/`rejected_lengths` (B,) are
    the completions' token counts, needed by ipo, sigmoid_norm and sft. With c = log pi(y_w|x) - log ref(y_w|x) and
    r = log pi(y_l|x) - log ref(y_l|x) (the log-ratios), h = c - r, and the same ratios averaged per token c', r':

    sigmoid:      -log sigma(beta h), DPO (Rafailov et al. 2023, eq. 7); label_smoothing eps > 0 makes it
                  conservative DPO (Mitchell 2023): -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
                  (TRL 1.16's sigmoid ignores label_smoothing; its robust and exo_pair use it)
    hinge:        max(0, 1 - beta h), SLiC (Zhao et al. 2023)
    ipo:          (c' - r' - 1/(2 beta))^2, IPO (Azar et al. 2023, eq. 17), on per-token averages as TRL does
    robust:       (-(1-eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps), rDPO (Chowdhury et al. 2024);
                  eps = label_smoothing in [0, 0.5)
    exo_pair:     KL(q || p) over {chosen, rejected}, q = (sigma(beta h), sigma(-beta h)), p = (1-eps, eps), EXO
                  (Ji et al. 2024, eq. 16); eps = label_smoothing in (0, 1)
    nca_pair:     -log sigma(beta c) - 0.5 log sigma(-beta c) - 0.5 log sigma(-beta r), NCA (Chen et al. 2024)
    bco_pair:     -log sigma(beta c) - log sigma(-beta r), BCO on pairs (Jung et al. 2024; without BCO's running
                  reward shift, as TRL's)
    sppo_hard:    (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2, SPPO with hard win probabilities (Wu et al. 2024)
    apo_zero:     1 - sigma(beta c) + sigma(beta r), APO-zero (D'Oosterlinck et al. 2024, eq. 7): chosen up,
                  rejected down; for chosen completions better than the model's own
    apo_down:     sigma(beta c) + 1 - sigma(beta h), APO-down (eq. 8): both down, rejected more
    discopop:     m = sigma(beta h / tau): (1 - m) (-log sigma(beta h)) + m exp(-beta h), DiscoPOP (Chris Lu et al.
                  2024, eq. 5); tau = discopop_tau
    sigmoid_norm: -log sigma(beta (c' - r')), DPO on per-token averages
    sft:          -log pi(y_w|x) / |y_w|, the chosen completion's per-token NLL (RPO, Pang et al. 2024, with
                  `sigmoid`); per pair, where TRL averages over all chosen tokens of its batch (equal when the
                  completions are equally long)
    Reference-free (REFERENCE_FREE_LOSS_TYPES: the ref arguments are not read), on the policy's per-token averages
    w = log pi(y_w|x) / |y_w| and l = log pi(y_l|x) / |y_l|:
    simpo:        -(1-eps) log sigma(beta (w - l) - gamma) - eps log sigma(gamma - beta (w - l)) + cpo_alpha (-w),
                  SimPO (Meng et al. 2024, eq. 6; gamma = simpo_gamma, the target margin) with CPO's NLL term (Xu et
                  al. 2024) weighted by cpo_alpha: TRL 1.16's CPOTrainer loss_type "simpo" (its cpo_alpha default
                  1.0; 0 is the SimPO paper's loss); its NLL per pair, as sft's
    orpo:         -w - beta log sigma(log odds(w) - log odds(l)), odds(p) = e^p / (1 - e^p), ORPO (Hong et al. 2024,
                  eqs. 4-7; TRL 1.16's ORPOTrainer with its beta, the paper's lambda); the NLL per pair, as sft's

    With another `f_divergence_type` (TRL's f-DPO), h and h' take f_divergence_score of c and of r in place of
    c and r; only the F_DIVERGENCE_LOSS_TYPES accept that.
    """
    c, r = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(f"--f_divergence_type {f_divergence_type} applies to loss types "
                         f"{', '.join(F_DIVERGENCE_LOSS_TYPES)}, not {loss_type}")
    score_c, score_r = (f_divergence_score(x, f_divergence_type, f_alpha_divergence_coef) for x in (c, r))
    h, eps = score_c - score_r, label_smoothing
    if loss_type in ("ipo", "sigmoid_norm", "sft", "simpo", "orpo"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type {loss_type}: pass chosen_lengths and rejected_lengths (per-token averages)")
        chosen_lengths, rejected_lengths = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        h_avg = score_c / chosen_lengths - score_r / rejected_lengths
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    if loss_type == "ipo":
        return (h_avg - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        q_w, q_l = torch.sigmoid(beta * h), torch.sigmoid(-beta * h)
        return (q_w * (F.logsigmoid(beta * h) - math.log1p(-eps))
                + q_l * (F.logsigmoid(-beta * h) - math.log(eps)))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * h)
    if loss_type == "discopop":
        m = torch.sigmoid(beta * h / discopop_tau)
        return (1 - m) * -F.logsigmoid(beta * h) + m * torch.exp(-beta * h)
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * h_avg)
    if loss_type == "sft":
        return -policy_chosen / chosen_lengths
    if loss_type in ("simpo", "orpo"):  # the docstring's w and l
        w, w_l = policy_chosen / chosen_lengths, policy_rejected / rejected_lengths
    if loss_type == "simpo":
        margin = beta * (w - w_l) - simpo_gamma
        return -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin) - cpo_alpha * w
    if loss_type == "orpo":
        log_odds = (w - w_l) - (_log1mexp(w) - _log1mexp(w_l))
        return -w - beta * F.logsigmoid(log_odds)
    raise ValueError(f"--loss_type: unknown value {loss_type!r}; choose from: {', '.join(DPO_LOSS_TYPES)}")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0, without cancellation: log1p(-e^x) below -log 2, log(-expm1(x)) above (Maechler 2012,
    as TRL's)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def implicit_rewards(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward r = beta * (log pi(y|x) - log ref(y|x)), shape (B,)."""
    return beta * (policy_logps - ref_logps).detach()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-example KTO loss, shape (B,) (Ethayarajh et al. 2024, eq. 7). With r = log pi(y|x) - log ref(y|x) and
    the reference point z0 = `kl` (a detached scalar, see kl_reference_point):

        desirable (label True):    lambda_D * (1 - sigma(beta * (r - z0)))
        undesirable (label False): lambda_U * (1 - sigma(beta * (z0 - r)))

    policy_logps (B,), ref_logps (B,) summed completion log-probs; labels (B,) bool; kl () -> (B,). Any mix of
    labels, including one class only or B = 0, is valid: the caller divides the sum by the global example count."""
    r = policy_logps - ref_logps
    kl = kl.detach()
    value = torch.where(labels, torch.sigmoid(beta * (r - kl)), torch.sigmoid(beta * (kl - r)))
    weight = torch.where(labels, desirable_weight, undesirable_weight).to(value.dtype)
    return weight * (1 - value)


def kl_reference_point(kl_logratio_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 = max(0, KL estimate), shape (). The estimate is the mean of
    log pi(y'|x) - log ref(y'|x) over mismatched pairs (x, y'): pass its sum and count already added up over all
    micro-batches and ranks, so every example of a step sees the same z0. Detached (no gradient flows through z0,
    as in the paper); 0 when count is 0."""
    return (kl_logratio_sum.detach() / count.clamp(min=1)).clamp(min=0)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_coefficient: float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss, shape (B,): -log sigma(r_w - r_l - m), the Bradley-Terry likelihood of the
    preference (InstructGPT, Ouyang et al. 2022, eq. 1), with the pair's margin m (Llama 2, Touvron et al. 2023,
    eq. 2; 0 when `margin` is None), plus center_coefficient * (r_w + r_l)^2, which keeps the rewards near zero
    mean (Eisenstein et al. 2023; TRL's center_rewards_coefficient). chosen r_w, rejected r_l, margin: (B,)."""
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    return -F.logsigmoid(diff) + center_coefficient * (chosen + rejected) ** 2
