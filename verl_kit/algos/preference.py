"""Preference losses as pure tensor functions. DPO/IPO/KTO take per-sequence log-probabilities summed (or averaged, for
IPO) over completion tokens; Bradley-Terry takes the reward model's scalar rewards. Outputs are per-example losses,
so the caller chooses and states the reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_logits(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor) -> torch.Tensor:
    """h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)).  All inputs (B,), output (B,)."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair DPO-family loss, shape (B,).

    sigmoid: -log sigma(beta*h), DPO (Rafailov et al. 2023, eq. 7); with label_smoothing eps > 0 it is the
             conservative DPO of Mitchell (2023): -(1-eps) log sigma(beta*h) - eps log sigma(-beta*h).
    ipo:     (h - 1/(2*beta))^2, IPO (Azar et al. 2023, eq. 17); pass length-averaged log-probs, as the paper does.
    """
    h = dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"--loss_type: unknown value {loss_type!r}; choose one of: sigmoid, ipo")


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
