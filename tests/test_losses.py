"""DPO-family losses against values worked by hand."""

import math

import pytest
import torch

from verl_kit.algos import dpo_logits, dpo_loss, implicit_rewards

# policy chosen/rejected, reference chosen/rejected log-probs of one pair
PC, PR, RC, RR = torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.5])


def test_dpo_sigmoid_hand_value():
    """h = (-10 - -11) - (-12 - -11.5) = 1 - (-0.5) = 1.5; beta = 0.1 -> beta*h = 0.15.
    loss = -log sigma(0.15) = log(1 + e^-0.15) = log(1 + 0.860708) = 0.620957."""
    assert dpo_logits(PC, PR, RC, RR).item() == pytest.approx(1.5)
    assert dpo_loss(PC, PR, RC, RR, beta=0.1).item() == pytest.approx(0.620957, abs=1e-6)


def test_conservative_dpo_hand_value():
    """eps = 0.2: 0.8 * log(1 + e^-0.15) + 0.2 * log(1 + e^0.15)
    = 0.8 * 0.620957 + 0.2 * 0.770957 = 0.496766 + 0.154191 = 0.650957."""
    loss = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.2)
    assert loss.item() == pytest.approx(0.650957, abs=1e-6)


def test_ipo_hand_value():
    """IPO: (h - 1/(2 beta))^2 with h = 1.5, beta = 0.1 -> (1.5 - 5)^2 = 12.25."""
    assert dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo").item() == pytest.approx(12.25)


def test_loss_is_per_pair_and_symmetric_at_zero():
    """Equal margins give log 2 per pair, whatever beta: -log sigma(0) = log 2."""
    z = torch.zeros(3)
    out = dpo_loss(z, z, z, z, beta=0.5)
    assert out.shape == (3,)
    assert torch.allclose(out, torch.full((3,), math.log(2)))


def test_implicit_rewards_and_bad_loss_type():
    """r = beta * (pi - ref): 0.1 * (-10 - -11) = 0.1."""
    assert implicit_rewards(PC, RC, 0.1).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="hinge2")


def test_gradient_direction():
    """d(-log sigma(beta h))/d pi_chosen = -beta * sigma(-beta h) < 0: the loss pushes chosen up."""
    pc = PC.clone().requires_grad_(True)
    dpo_loss(pc, PR, RC, RR, beta=0.1).sum().backward()
    expected = -0.1 * torch.sigmoid(torch.tensor(-0.15)).item()
    assert pc.grad.item() == pytest.approx(expected, abs=1e-7)
