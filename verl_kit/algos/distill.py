"""On-policy distillation losses as pure tensor functions on the scored response tokens of a micro-batch, (M,).

The student samples, a frozen teacher scores the sampled tokens; two ways to turn that into a loss (docs/distill.md):
  reverse_kl_advantages  the per-token advantage -(log p_student - log q_teacher) of the sampled token, fed to the
                         clipped policy loss (Agarwal et al. 2024; Thinking Machines' tinker-cookbook
                         distillation/train_on_policy.py): one log-prob per token from the teacher
  generalized_jsd        TRL's generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024, eq. 1) between the
                         student's and the teacher's next-token distributions over the whole vocabulary
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """A_t = -(log p(y_t) - log q(y_t)) of each sampled token, detached: the one-sample estimate of the per-token
    reverse KL(p || q), negated, so the policy gradient raises tokens the teacher likes more than the student does
    and lowers the others. (M,), (M,) -> (M,)."""
    return -(student_logprobs - teacher_logprobs).detach()


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD per token over the whole vocabulary, TRL's `generalized_jsd_loss` without the reduction.
    With p = softmax(student), q = softmax(teacher) and the mixture m = (1 - beta) p + beta q:
        beta = 0        KL(q || p)                          forward KL (mode-covering)
        beta = 1        KL(p || q)                          reverse KL (mode-seeking)
        0 < beta < 1    beta KL(q || m) + (1 - beta) KL(p || m)
    Logits already divided by the temperature; the teacher's carry no gradient. (M, V), (M, V) -> (M,)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta {beta}: the interpolation coefficient must be in [0, 1]")
    lp = F.log_softmax(student_logits.float(), -1)
    lq = F.log_softmax(teacher_logits.detach().float(), -1)
    if beta == 0.0:
        return (lq.exp() * (lq - lp)).sum(-1)
    if beta == 1.0:
        return (lp.exp() * (lp - lq)).sum(-1)
    lm = torch.logsumexp(torch.stack([lp + math.log1p(-beta), lq + math.log(beta)]), 0)
    return beta * (lq.exp() * (lq - lm)).sum(-1) + (1.0 - beta) * (lp.exp() * (lp - lm)).sum(-1)
