"""verl_kit.algos.policy against values worked by hand: PPO's clipped surrogate, the clipped value loss, the entropy;
clip-higher, GSPO's sequence-level ratio and CISPO, every POLICY_LOSSES entry with its TRL reduction, and the same
values and gradients as TRL 1.16's GRPOTrainer._compute_loss written out on padded tensors (and as verl's
stop-gradient form of GSPO)."""

import math

import pytest
import torch

from verl_kit.algos import (
    POLICY_LOSSES,
    REDUCTIONS,
    cispo,
    clipped_surrogate,
    entropy_from_logits,
    loss_weights,
    sequence_log_ratio,
    value_loss,
)
from verl_kit.data import logprobs_from_logits


def test_policy_loss_hand_values():
    """clip 0.2, ratio = exp(logp - old), loss = max(-A r, -A clip(r, 0.8, 1.2)):
    A=+1, r=1.5: max(-1.5, -1.2) = -1.2  clipped      A=-1, r=1.5: max(1.5, 1.2) = 1.5  not clipped
    A=+1, r=0.5: max(-0.5, -0.8) = -0.5  not clipped  A=-1, r=0.5: max(0.5, 0.8) = 0.8  clipped"""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    old = torch.zeros(4)
    logp = ratio.log()
    loss, clipped = clipped_surrogate(logp, logp - old, adv, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # the gradient of a clipped token is zero, of an unclipped one -A * r
    logp = logp.clone().requires_grad_(True)
    clipped_surrogate(logp, logp - old, adv, 0.2).loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.5, -0.5, 0.0]))


def test_value_loss_hand_values():
    """clip 0.2, V_clip = old + clip(V - old, -0.2, 0.2), loss = 0.5 max((V-G)^2, (V_clip-G)^2):
    V=0.5, old=0, G=1:    (0.25, (0.2-1)^2 = 0.64)  -> 0.32   clipped branch larger
    V=1.1, old=1, G=1:    (0.01, 0.01)              -> 0.005  equal, not counted as clipped
    V=-0.5, old=0, G=-1:  (0.25, 0.64)              -> 0.32   clipped
    V=2, old=0, G=1:      (1.0, 0.64)               -> 0.5    not clipped"""
    v = torch.tensor([0.5, 1.1, -0.5, 2.0])
    old = torch.tensor([0.0, 1.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, -1.0, 1.0])
    v = v.requires_grad_()
    loss, clipped = value_loss(v, old, ret, 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.005, 0.32, 0.5]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert loss.requires_grad and not clipped.requires_grad  # the indicator is a metric, no graph


def test_entropy_and_logprobs():
    """logits [0, 0]: H = ln 2 = 0.693147. logits [0, ln 3]: p = [0.25, 0.75],
    H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335; log p(token 1) = ln 0.75 = -0.287682."""
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([0.693147, 0.562335]))
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([0, 1])),
                               torch.tensor([-0.693147, -0.287682]))


# ---- RLVR variants: clip-higher, GSPO, CISPO ------------------------------------------------------------------------


def test_clip_higher_by_hand():
    """Ratios r = [1.3, 1.3, 0.7, 0.7, 1.25], advantages A = [1, -1, 1, -1, 1], loss max(-A r, -A clip(r)).
    Symmetric, eps = 0.2, clip to [0.8, 1.2]:
      r=1.3,  A=+1: max(-1.3, -1.2) = -1.2    clipped     r=1.3, A=-1: max(1.3, 1.2) = 1.3
      r=0.7,  A=+1: max(-0.7, -0.8) = -0.7                r=0.7, A=-1: max(0.7, 0.8) = 0.8   clipped
      r=1.25, A=+1: max(-1.25, -1.2) = -1.2   clipped
    Clip-higher, eps = 0.2, eps_high = 0.28, clip to [0.8, 1.28]: r=1.3, A=+1 -> max(-1.3, -1.28) = -1.28 (clipped);
    r=1.25, A=+1 -> max(-1.25, -1.25) = -1.25, no longer clipped: its gradient d/d log r = -A r = -1.25 (0 before).
    The lower side is unchanged: r=0.7, A=-1 still 0.8."""
    r = torch.tensor([1.3, 1.3, 0.7, 0.7, 1.25], dtype=torch.float64)
    A = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    log_r = r.log().requires_grad_()
    sym, sym_clipped = clipped_surrogate(log_r, log_r, A, 0.2)
    torch.testing.assert_close(sym, torch.tensor([-1.2, 1.3, -0.7, 0.8, -1.2], dtype=torch.float64))
    assert sym_clipped.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    high, high_clipped = clipped_surrogate(log_r, log_r, A, 0.2, 0.28)
    torch.testing.assert_close(high, torch.tensor([-1.28, 1.3, -0.7, 0.8, -1.25], dtype=torch.float64))
    assert high_clipped.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    (grad,) = torch.autograd.grad(high[4], log_r)
    assert grad[4].item() == pytest.approx(-1.25)
    (grad,) = torch.autograd.grad(sym[4], log_r)
    assert grad[4].item() == 0.0


def test_gspo_sequence_ratio_by_hand():
    """Two responses packed in the order [seq 0, seq 1, seq 0] (a micro-batch's flattened tokens). Log-ratios
    log pi - log pi_old: seq 0 has [0.1, 0.3], mean 0.2; seq 1 has [-0.3], mean -0.3. Every token carries its
    sequence's mean: [0.2, -0.3, 0.2]. Gradient of sum(out * [1, 10, 100]) with respect to log pi: a token of seq 0
    gets (1 + 100) / 2 = 50.5 (each of its two tokens moves the mean by 1/2), the token of seq 1 gets 10.
    The loss with A = [1, -1, 1]: s_0 = exp(0.2) = 1.221403 > 1.2, so with eps 0.2 both tokens of seq 0 are clipped
    to -1.2; s_1 = exp(-0.3) = 0.740818 with A = -1: max(0.740818, 0.8) = 0.8 (clipped); with eps_high 0.28 seq 0
    is inside [0.8, 1.28]: -1.221403."""
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([0.1, -0.3, 0.3], dtype=torch.float64)
    seq = torch.tensor([0, 1, 0])
    lr = sequence_log_ratio(logp, old, seq, 2)
    torch.testing.assert_close(lr, torch.tensor([0.2, -0.3, 0.2], dtype=torch.float64))
    (grad,) = torch.autograd.grad((lr * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)).sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([50.5, 10.0, 50.5], dtype=torch.float64))
    A = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, clipped = clipped_surrogate(logp, lr, A, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -1.2], dtype=torch.float64))
    assert clipped.tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(clipped_surrogate(logp, lr, A, 0.2, 0.28).loss,
                               torch.tensor([-1.221403, 0.8, -1.221403], dtype=torch.float64), atol=1e-6, rtol=0)


def test_cispo_by_hand():
    """log pi = [ln 0.5, ln 0.25, ln 0.5], ratios r = [2, 8, 8], A = [1, 1, -1], cap 5: weights min(r, 5) = [2, 5, 5],
    detached. Loss -w A log pi = [-2 ln 0.5, -5 ln 0.25, 5 ln 0.5] = [1.386294, 6.931472, -3.465736]; its gradient
    with respect to log pi is -w A = [-2, -5, 5] (no token is cut, however far its ratio moved). The capped-weight
    metric counts r > cap with A > 0 only (TRL's cispo_clip_ratio): [0, 1, 0]."""
    logp = torch.tensor([0.5, 0.25, 0.5], dtype=torch.float64).log().requires_grad_()
    log_r = torch.tensor([2.0, 8.0, 8.0], dtype=torch.float64).log()
    A = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, clipped = cispo(logp, log_r, A, 0.2, 5.0)
    torch.testing.assert_close(loss, torch.tensor([1.386294, 6.931472, -3.465736], dtype=torch.float64), atol=1e-6,
                               rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([-2.0, -5.0, 5.0], dtype=torch.float64))
    assert clipped.tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="cispo needs clip_high"):
        cispo(logp, log_r, A, 0.2)


@pytest.mark.parametrize("name", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_policy_losses_by_hand(name):
    """Every POLICY_LOSSES entry, called as the recipe calls it, with clip 0.2 and clip_high 1.0:
    log pi = [ln 0.5, ln 0.5, ln 0.25, ln 0.25], ratios r = [3, 1.5, 0.5, 0.5], A = [1, 1, -1, 1].
    clipped_surrogate (dapo, grpo, dr_grpo), clip to [0.8, 2.0], loss max(-A r, -A clip(r)):
      r=3, A=+1: max(-3, -2) = -2  clipped      r=1.5, A=+1: max(-1.5, -1.5) = -1.5  not clipped (equal)
      r=0.5, A=-1: max(0.5, 0.8) = 0.8  clipped  r=0.5, A=+1: max(-0.5, -0.8) = -0.5  not clipped
      gradient with respect to log r: -A r on the unclipped tokens, 0 on the clipped: [0, -1.5, 0, -0.5].
    cispo, cap 1.0: weights min(r, 1) = [1, 1, 0.5, 0.5]; loss -w A log pi =
      [ln 0.5 * -1, ln 0.5 * -1, ln 0.25 * -0.5, ln 0.25 * 0.5] = [0.693147, 0.693147, -0.693147, 0.693147];
      capped where r > 1 with A > 0: [1, 1, 0, 0]; gradient with respect to log pi -w A = [-1, -1, 0.5, -0.5], none
      with respect to log r (the weight is detached).
    The reductions are TRL's for the name (GRPOConfig.loss_type): dapo and cispo token, grpo sequence, dr_grpo
    constant."""
    logp = torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=torch.float64).log().requires_grad_()
    log_r = torch.tensor([3.0, 1.5, 0.5, 0.5], dtype=torch.float64).log().requires_grad_()
    A = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    clip = ([-2.0, -1.5, 0.8, -0.5], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, -1.5, 0.0, -0.5])
    cap = ([0.693147, 0.693147, -0.693147, 0.693147], [1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, 0.5, -0.5],
           [0.0, 0.0, 0.0, 0.0])
    want_loss, want_clipped, want_grad_logp, want_grad_log_r = {"dapo": clip, "grpo": clip, "dr_grpo": clip,
                                                                "cispo": cap}[name]
    policy_loss = POLICY_LOSSES[name]
    loss, clipped = policy_loss.surrogate(logp, log_r, A, 0.2, 1.0)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=torch.float64), atol=1e-6, rtol=0)
    assert clipped.tolist() == want_clipped and clipped.dtype == torch.float32 and not clipped.requires_grad
    grads = torch.autograd.grad(loss.sum(), (logp, log_r), allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(grads[0], torch.tensor(want_grad_logp, dtype=torch.float64))
    torch.testing.assert_close(grads[1], torch.tensor(want_grad_log_r, dtype=torch.float64))
    trl = {"dapo": "token", "grpo": "sequence", "dr_grpo": "constant", "cispo": "token"}
    assert policy_loss.reduction == trl[name] and policy_loss.reduction in REDUCTIONS
    assert sorted(POLICY_LOSSES) == sorted(trl)  # a new loss gets its row here, its hand values and its TRL reduction


def _padded(seed=0):
    """Three responses of 4, 2 and 3 tokens, right-padded to 4, with random log-probs, old log-probs (ratios up
    to ~e^0.5) and advantages; and the same tokens flattened as the recipe sees them (M,) with seq_index."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    logp = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)
    seq = torch.arange(3)[:, None].expand(3, 4)[mask]
    return mask, logp, old, adv, seq


def _trl_loss(logp, old, adv, mask, level, loss_type, eps, eps_high):
    """TRL 1.16 GRPOTrainer._compute_loss, the lines for these options, on padded (B, T) tensors (beta = 0)."""
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    advantages = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":  # max_completion_length = T
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * per_token_loss.size(1))
    return (per_token_loss * mask).sum() / mask.sum()  # dapo, cispo: one process, one micro-batch


@pytest.mark.parametrize("level,loss_type", [("token", "dapo"), ("sequence", "dapo"), ("sequence", "grpo"),
                                             ("token", "dr_grpo"), ("token", "cispo"), ("sequence", "cispo")])
def test_losses_match_trl_formula(level, loss_type):
    """Same small inputs through TRL's formula on padded tensors and through the kit's flattened tokens with
    the surrogate and reduction POLICY_LOSSES declares for the name: equal loss and equal gradient with respect to
    every log-prob, for clip-higher (eps 0.2, eps_high 0.28), GSPO, Dr. GRPO and CISPO (cap 1.3, so some weights are
    capped)."""
    mask, logp, old, adv, seq = _padded()
    eps, eps_high = 0.2, (1.3 if loss_type == "cispo" else 0.28)
    lp = logp.clone().requires_grad_()
    want = _trl_loss(lp, old, adv, mask, level, loss_type, eps, eps_high)
    (want_grad,) = torch.autograd.grad(want, lp)

    flat = logp[mask].clone().requires_grad_()
    o, a = old[mask], adv[seq]
    log_ratio = sequence_log_ratio(flat, o, seq, 3) if level == "sequence" else flat - o
    policy_loss = POLICY_LOSSES[loss_type]  # the surrogate and reduction the recipe looks up for --loss_type
    loss = policy_loss.surrogate(flat, log_ratio, a, eps, eps_high).loss
    lengths = mask.sum(-1)[seq]
    w = loss_weights(policy_loss.reduction, lengths, float(mask.sum()), 3.0, 4)
    got = (loss * w).sum()
    (got_grad,) = torch.autograd.grad(got, flat)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad[mask])
    if loss_type == "cispo" and level == "token":  # the cap is active on some tokens only, or it would not be tested
        capped = log_ratio.detach().exp() > eps_high
        assert capped.any() and not capped.all()


def test_gspo_gradient_equals_verl_stop_gradient_form():
    """verl's GSPO writes the ratio per token as exp(sg[log s_i] + log pi_t - sg[log pi_t]): the same value as TRL's
    mean, and (with loss weights equal within a response, as every loss_type's are) the same gradient."""
    mask, logp, old, adv, seq = _padded(seed=1)
    flat, o, a = logp[mask], old[mask], adv[seq]
    w = loss_weights("sequence", mask.sum(-1)[seq], float(mask.sum()), 3.0, 4)
    ours = flat.clone().requires_grad_()
    lr = sequence_log_ratio(ours, o, seq, 3)
    (g_ours,) = torch.autograd.grad((clipped_surrogate(ours, lr, a, 0.2, 0.28).loss * w).sum(), ours)
    theirs = flat.clone().requires_grad_()
    seq_mean = sequence_log_ratio(theirs, o, seq, 3).detach()
    lr_verl = theirs - theirs.detach() + seq_mean
    torch.testing.assert_close(lr_verl, lr.detach())
    (g_verl,) = torch.autograd.grad((clipped_surrogate(theirs, lr_verl, a, 0.2, 0.28).loss * w).sum(), theirs)
    torch.testing.assert_close(g_ours, g_verl)
