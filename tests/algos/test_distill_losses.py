"""verl_kit.algos.distill against values worked by hand: the reverse-KL advantages and the generalized JSD."""

import math

import pytest
import torch

from verl_kit.algos import generalized_jsd, reverse_kl_advantages

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_reverse_kl_advantages_by_hand():
    """Sampled tokens with student/teacher probabilities (1/2, 1/4), (1/4, 1/2), (1/3, 1/3): A = -(log p - log q) =
    -ln 2, +ln 2, 0. The advantage carries no gradient (it is a constant of the policy loss)."""
    s = torch.log(torch.tensor([0.5, 0.25, 1 / 3])).requires_grad_()
    q = torch.log(torch.tensor([0.25, 0.5, 1 / 3]))
    a = reverse_kl_advantages(s, q)
    assert torch.allclose(a, torch.tensor([-LN2, LN2, 0.0]), atol=1e-6)
    assert not a.requires_grad


def test_generalized_jsd_by_hand():
    """Two tokens. Student logits (0, 0): p = (1/2, 1/2); teacher logits (ln 3, 0): q = (3/4, 1/4).
    beta 0, forward KL(q || p) = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.304099 - 0.173287 = 0.130812.
    beta 1, reverse KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = -0.202733 + 0.346574 = 0.143841.
    beta 0.5: m = (5/8, 3/8); KL(q || m) = 3/4 ln(6/5) + 1/4 ln(2/3) = 0.136741 - 0.101366 = 0.035375;
    KL(p || m) = 1/2 ln(4/5) + 1/2 ln(4/3) = -0.111572 + 0.143841 = 0.032269; JSD = (0.035375 + 0.032269) / 2
    = 0.033822. (TRL's generalized_jsd_loss with reduction='none', summed over the vocabulary, gives the same to
    1e-7 on random logits; importing it costs 10-30 s, so that check is not repeated here.)
    The gradient flows to the student only, and vanishes where the student equals the teacher."""
    s = torch.tensor([[0.0, 0.0], [LN3, 0.0]], requires_grad=True)
    t = torch.tensor([[LN3, 0.0], [LN3, 0.0]], requires_grad=True)
    for beta, want in ((0.0, 0.130812), (1.0, 0.143841), (0.5, 0.033822)):
        got = generalized_jsd(s, t, beta)
        assert got.shape == (2,)
        assert got[0].item() == pytest.approx(want, abs=1e-5), beta
        assert got[1].item() == pytest.approx(0.0, abs=1e-6), beta
    generalized_jsd(s, t, 0.5).sum().backward()
    assert t.grad is None and s.grad[0].abs().sum() > 0 and s.grad[1].abs().max() < 1e-6
    with pytest.raises(ValueError, match="beta 1.5"):
        generalized_jsd(s, t, 1.5)
