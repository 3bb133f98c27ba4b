"""verl_kit.algos.preference against values worked by hand: every DPO loss type and f-divergence; KTO's loss, its
reference point, robust batches and the reduction over shards; the reward model's Bradley-Terry loss and its
centering term."""

import math

import pytest
import torch

from verl_kit.algos import bradley_terry_loss, dpo_loss, implicit_rewards, kl_reference_point, kto_loss

# ---- DPO ------------------------------------------------------------------------------------------------------------


# policy chosen/rejected, reference chosen/rejected log-probs of one pair
PC, PR, RC, RR = torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.5])


def test_dpo_sigmoid_hand_value():
    """h = (-10 - -11) - (-12 - -11.5) = 1 - (-0.5) = 1.5; beta = 0.1 -> beta*h = 0.15.
    loss = -log sigma(0.15) = log(1 + e^-0.15) = log(1 + 0.860708) = 0.620957."""
    assert dpo_loss(PC, PR, RC, RR, beta=0.1).item() == pytest.approx(0.620957, abs=1e-6)


def test_conservative_dpo_hand_value():
    """eps = 0.2: 0.8 * log(1 + e^-0.15) + 0.2 * log(1 + e^0.15)
    = 0.8 * 0.620957 + 0.2 * 0.770957 = 0.496766 + 0.154191 = 0.650957."""
    loss = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.2)
    assert loss.item() == pytest.approx(0.650957, abs=1e-6)


def test_ipo_hand_value():
    """IPO on per-token averages: chosen 4 tokens, rejected 5: c' = 1/4 = 0.25, r' = -0.5/5 = -0.1, h' = 0.35;
    (h' - 1/(2 beta))^2 = (0.35 - 5)^2 = 21.6225. With lengths 1 it is (h - 5)^2 = (1.5 - 5)^2 = 12.25."""
    assert dpo_loss(PC, PR, RC, RR, 0.1, "ipo", chosen_lengths=LC, rejected_lengths=LR).item() == \
        pytest.approx(21.6225)
    one = torch.ones(1)
    assert dpo_loss(PC, PR, RC, RR, 0.1, "ipo", chosen_lengths=one, rejected_lengths=one).item() == \
        pytest.approx(12.25)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(PC, PR, RC, RR, 0.1, "ipo")


# TRL 1.16's DPOConfig.loss_type variants on the same pair: c = -10 - -11 = 1 (chosen log-ratio), r = -12 - -11.5 =
# -0.5 (rejected), h = c - r = 1.5, beta = 0.1; log sigma(x) = -log(1 + e^-x), sigma(0.1) = 0.524979,
# sigma(0.15) = 0.537430, sigma(-0.05) = 0.487503.
LC, LR = torch.tensor([4.0]), torch.tensor([5.0])  # completion lengths, for the per-token losses


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    # max(0, 1 - beta h) = 1 - 0.15
    ("hinge", {}, 0.85),
    # rDPO: (-(1-e) log s(bh) + e log s(-bh)) / (1 - 2e); log s(-x) = log s(x) - x gives -log s(bh) - e bh / (1 - 2e)
    # = 0.620957 - 0.2 * 0.15 / 0.6 = 0.620957 - 0.05
    ("robust", {"label_smoothing": 0.2}, 0.570957),
    # EXO: q = (s(0.15), s(-0.15)) = (0.537430, 0.462570), p = (1 - 1e-3, 1e-3):
    # 0.537430 (log 0.537430 - log 0.999) + 0.462570 (log 0.462570 - log 0.001)
    # = 0.537430 (-0.620957 + 0.001001) + 0.462570 (-0.770957 + 6.907755) = -0.333180 + 2.838697
    ("exo_pair", {"label_smoothing": 1e-3}, 2.505517),
    # -log s(0.1) - 0.5 log s(-0.1) - 0.5 log s(0.05) = 0.644397 + 0.372198 + 0.334230
    ("nca_pair", {}, 1.350825),
    # -log s(0.1) - log s(0.05) = 0.644397 + 0.668460
    ("bco_pair", {}, 1.312856),
    # (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2 = (1 - 5)^2 + (-0.5 + 5)^2 = 16 + 20.25
    ("sppo_hard", {}, 36.25),
    # 1 - s(beta c) + s(beta r) = 1 - 0.524979 + 0.487503
    ("apo_zero", {}, 0.962524),
    # s(beta c) + 1 - s(beta h) = 0.524979 + 1 - 0.537430
    ("apo_down", {}, 0.987549),
    # m = s(0.15 / 0.05) = s(3) = 0.952574: (1 - m) 0.620957 + m e^-0.15 = 0.029449 + 0.952574 * 0.860708
    ("discopop", {"discopop_tau": 0.05}, 0.849338),
    # -log s(beta h') with h' = 0.25 - -0.1 = 0.35: log(1 + e^-0.035)
    ("sigmoid_norm", {"chosen_lengths": LC, "rejected_lengths": LR}, 0.675800),
    # the chosen completion's per-token NLL: 10 / 4
    ("sft", {"chosen_lengths": LC, "rejected_lengths": LR}, 2.5),
    # SimPO, no reference: w = -10/4 = -2.5, l = -12/5 = -2.4, margin = beta (w - l) - gamma = -0.01 - 0.5 = -0.51;
    # -log s(-0.51) = log(1 + e^0.51) = 0.980313, plus cpo_alpha (1, TRL's default) times the NLL -w = 2.5
    ("simpo", {"chosen_lengths": LC, "rejected_lengths": LR}, 3.480313),
    # the SimPO paper's loss (cpo_alpha 0) with label smoothing 0.1: 0.9 * 0.980313 + 0.1 * log(1 + e^-0.51)
    # = 0.882282 + 0.1 * 0.470313
    ("simpo", {"chosen_lengths": LC, "rejected_lengths": LR, "cpo_alpha": 0.0, "label_smoothing": 0.1}, 0.929313),
    # ORPO: log odds(p) = p - log(1 - e^p): w -> -2.5 + 0.085650, l -> -2.4 + 0.095103, difference -0.109449;
    # NLL 2.5 - beta log s(-0.109449) = 2.5 + 0.1 * 0.749369
    ("orpo", {"chosen_lengths": LC, "rejected_lengths": LR}, 2.574937),
])
def test_dpo_variant_hand_values(loss_type, kwargs, expected):
    assert dpo_loss(PC, PR, RC, RR, 0.1, loss_type, **kwargs).item() == pytest.approx(expected, abs=1e-6)


def test_reference_free_losses_read_no_reference_and_match_trl():
    """simpo and orpo do not read the reference log-probs, and equal TRL 1.16's own CPOTrainer.cpo_loss (loss_type
    "simpo", plus cpo_alpha times its NLL) and ORPOTrainer.odds_ratio_loss (NLL minus its beta * log sigma(log odds))
    on per-token averages, called on TRL's code itself; the NLL is per pair here, per batch token there: equal for
    one pair."""
    import warnings
    from types import SimpleNamespace

    with warnings.catch_warnings():  # TRL's notice that trl.experimental may change: its formulas are what we compare
        warnings.simplefilter("ignore")
        from trl.experimental.cpo.cpo_trainer import CPOTrainer
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    w, w_l = PC / LC, PR / LR
    other = (torch.tensor([-3.0]), torch.tensor([7.0]))
    for loss_type in ("simpo", "orpo"):
        ours = [dpo_loss(PC, PR, *ref, 0.2, loss_type, 0.05 if loss_type == "simpo" else 0.0, LC, LR,
                         simpo_gamma=0.7, cpo_alpha=0.3) for ref in ((RC, RR), other)]
        assert torch.equal(ours[0], ours[1]), loss_type
    device = SimpleNamespace(device="cpu")
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=0.2, label_smoothing=0.05,
                          accelerator=device)
    trl_simpo = CPOTrainer.cpo_loss(cpo, w, w_l)[0] + 0.3 * -w
    orpo = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.2, accelerator=device), w, w_l)
    trl_orpo = -w - orpo[0]
    for loss_type, trl in (("simpo", trl_simpo), ("orpo", trl_orpo)):
        ours = dpo_loss(PC, PR, RC, RR, 0.2, loss_type, 0.05 if loss_type == "simpo" else 0.0, LC, LR,
                        simpo_gamma=0.7, cpo_alpha=0.3)
        torch.testing.assert_close(ours, trl, rtol=0, atol=1e-6)


def test_every_dpo_loss_type_has_a_hand_value():
    from verl_kit.algos import DPO_LOSS_TYPES

    worked = {"sigmoid", "ipo"}  # their own tests above
    params = test_dpo_variant_hand_values.pytestmark[0].args[1]
    assert set(DPO_LOSS_TYPES) == worked | {p[0] for p in params}


@pytest.mark.parametrize("f_divergence_type, sigmoid, hinge", [
    # f'(u) at u = pi/ref: forward_kl 1 - 1/u: c -> 1 - e^-1 = 0.632121, r -> 1 - e^0.5 = -0.648721, h = 1.280842;
    # -log s(0.1280842) = 0.631154, 1 - 0.1280842 = 0.871916
    ("forward_kl", 0.631154, 0.871916),
    # js_divergence log 2 + log s(log u): c -> 0.693147 - 0.313262 = 0.379885, r -> 0.693147 - 0.974077 = -0.280930,
    # h = 0.660815; -log s(0.0660815) = 0.660652, 1 - 0.0660815 = 0.933918
    ("js_divergence", 0.660652, 0.933918),
    # alpha_divergence, alpha 0.5: (u^-0.5 - 1) / -0.5: c -> (e^-0.5 - 1) / -0.5 = 0.786939,
    # r -> (e^0.25 - 1) / -0.5 = -0.568051, h = 1.354990; -log s(0.135499) = 0.627691, 1 - 0.135499 = 0.864501
    ("alpha_divergence", 0.627691, 0.864501),
])
def test_f_divergence_hand_values(f_divergence_type, sigmoid, hinge):
    for loss_type, expected in (("sigmoid", sigmoid), ("hinge", hinge)):
        loss = dpo_loss(PC, PR, RC, RR, 0.1, loss_type, f_divergence_type=f_divergence_type)
        assert loss.item() == pytest.approx(expected, abs=1e-6), loss_type


def test_f_divergence_on_per_token_averages():
    """sigmoid_norm with js_divergence (lengths 4 and 5): h' = 0.379885 / 4 - -0.280930 / 5 = 0.094971 + 0.056186 =
    0.151157, -log s(0.0151157) = 0.685618 (log 2's constant in f' no longer cancels: the lengths differ)."""
    loss = dpo_loss(PC, PR, RC, RR, 0.1, "sigmoid_norm", chosen_lengths=LC, rejected_lengths=LR,
                    f_divergence_type="js_divergence")
    assert loss.item() == pytest.approx(0.685618, abs=1e-6)


def test_f_divergence_limits_and_refusals():
    """reverse_kl is DPO; alpha_divergence at alpha 1 is its limit, log u; a loss type built on c and r apart
    (here nca_pair) refuses another divergence, as TRL does."""
    from verl_kit.algos import f_divergence_score

    x = torch.tensor([-2.0, 0.0, 1.5])
    assert torch.equal(f_divergence_score(x, "alpha_divergence", 1.0), x)
    assert torch.allclose(f_divergence_score(x, "alpha_divergence", 1.0 + 1e-4), x, atol=1e-3)
    assert dpo_loss(PC, PR, RC, RR, 0.1, f_divergence_type="reverse_kl").item() == pytest.approx(0.620957, abs=1e-6)
    with pytest.raises(ValueError, match="applies to loss types .* not nca_pair"):
        dpo_loss(PC, PR, RC, RR, 0.1, "nca_pair", f_divergence_type="forward_kl")


def test_dpo_variant_gradients_point_the_documented_way():
    """apo_zero raises the chosen completion and lowers the rejected one; apo_down lowers both, the rejected more
    (APO, eqs. 7-8); sft moves the chosen one only, by -1/|y_w| = -0.25."""
    def grads(loss_type):
        pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
        dpo_loss(pc, pr, RC, RR, 0.1, loss_type, chosen_lengths=LC, rejected_lengths=LR).sum().backward()
        return pc.grad.item(), (pr.grad.item() if pr.grad is not None else 0.0)
    gc, gr = grads("apo_zero")
    assert gc < 0 < gr  # descent raises chosen, lowers rejected
    gc, gr = grads("apo_down")
    assert 0 < gc < gr  # both down, the rejected more
    # d/dc [s(0.1 c) + 1 - s(0.1 (c - r))] = 0.1 (s'(0.1) - s'(0.15)); d/dr = 0.1 s'(0.15)
    s1, s15 = 0.524979 * (1 - 0.524979), 0.537430 * (1 - 0.537430)
    assert (gc, gr) == (pytest.approx(0.1 * (s1 - s15), abs=1e-7), pytest.approx(0.1 * s15, abs=1e-7))
    assert grads("sft") == (pytest.approx(-0.25), 0.0)


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


def test_dpo_loss_terms_parse_the_flags():
    """`--loss_type sigmoid,sft --loss_weights 1,0.2` (RPO) -> the weighted terms: 0.620957 + 0.2 * 2.5 = 1.120957."""
    from verl_kit.algos import dpo_loss_terms

    terms = dpo_loss_terms("sigmoid, sft", "1,0.2")
    assert terms == [("sigmoid", 1.0), ("sft", 0.2)]
    total = sum(w * dpo_loss(PC, PR, RC, RR, 0.1, t, chosen_lengths=LC, rejected_lengths=LR) for t, w in terms)
    assert total.item() == pytest.approx(1.120957, abs=1e-6)
    assert dpo_loss_terms("ipo") == [("ipo", 1.0)]
    with pytest.raises(ValueError, match="^loss_weights 1,2,3: 3 weight"):
        dpo_loss_terms("sigmoid,sft", "1,2,3")


# ---- KTO ------------------------------------------------------------------------------------------------------------


LN3 = math.log(3)


def test_kto_loss_hand_worked():
    """beta = 0.5, z0 = 0.4, lambda_D = 2, lambda_U = 0.5, ref log-probs all -2, so r = policy + 2.

    ex 1 desirable,   r = 0.4:          sigma(0.5 (0.4 - 0.4)) = sigma(0) = 1/2         loss = 2 (1 - 1/2) = 1
    ex 2 desirable,   r = 0.4 + 2 ln 3: sigma(0.5 * 2 ln 3) = sigma(ln 3) = 3/4         loss = 2 (1 - 3/4) = 0.5
    ex 3 undesirable, r = 0.4 + 2 ln 3: sigma(0.5 (0.4 - r)) = sigma(-ln 3) = 1/4       loss = 0.5 (1 - 1/4) = 0.375
    ex 4 undesirable, r = 0.4 - 2 ln 3: sigma(ln 3) = 3/4                               loss = 0.5 (1 - 3/4) = 0.125

    Gradients w.r.t. the policy log-prob, with sigma' = sigma (1 - sigma):
    desirable   d/dr lambda_D (1 - sigma(beta (r - z0))) = -lambda_D beta sigma'   ex 1: -2 * 0.5 * 1/4 = -0.25
                                                                                  ex 2: -2 * 0.5 * 3/16 = -0.1875
    undesirable d/dr lambda_U (1 - sigma(beta (z0 - r))) = +lambda_U beta sigma'   ex 3: 0.5 * 0.5 * 3/16 = 0.046875
                                                                                  ex 4: 0.5 * 0.5 * 3/16 = 0.046875
    z0 is detached: no gradient reaches it."""
    r = torch.tensor([0.4, 0.4 + 2 * LN3, 0.4 + 2 * LN3, 0.4 - 2 * LN3], dtype=torch.float64)
    policy = (r - 2).requires_grad_()
    kl = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([True, True, False, False])
    losses = kto_loss(policy, torch.full((4,), -2.0, dtype=torch.float64), labels, kl, beta=0.5,
                      desirable_weight=2.0, undesirable_weight=0.5)
    torch.testing.assert_close(losses, torch.tensor([1.0, 0.5, 0.375, 0.125], dtype=torch.float64))
    losses.sum().backward()
    torch.testing.assert_close(policy.grad, torch.tensor([-0.25, -0.1875, 0.046875, 0.046875], dtype=torch.float64))
    assert kl.grad is None


def test_kto_loss_default_weights_and_symmetry():
    """beta = 1, z0 = 0, weights 1: a desirable r = ln 3 gives 1 - sigma(ln 3) = 1/4, an undesirable r = ln 3 gives
    1 - sigma(-ln 3) = 3/4; swapping the sign of r swaps them."""
    r = torch.tensor([LN3, LN3, -LN3, -LN3])
    losses = kto_loss(r, torch.zeros(4), torch.tensor([True, False, True, False]), torch.tensor(0.0), beta=1.0)
    torch.testing.assert_close(losses, torch.tensor([0.25, 0.75, 0.75, 0.25]))


def test_kl_reference_point_mean_clamp_and_detach():
    """Sum 3 over 4 pairs -> 0.75. Sum -3 over 4 -> mean -0.75, clamped to 0 (a KL is never negative; the sample
    estimate can be). No pairs -> 0, not 0/0. The result carries no gradient."""
    s = torch.tensor(3.0, requires_grad=True)
    z0 = kl_reference_point(s, torch.tensor(4))
    assert z0.item() == 0.75 and not z0.requires_grad
    assert kl_reference_point(torch.tensor(-3.0), torch.tensor(4)).item() == 0.0
    assert kl_reference_point(torch.tensor(0.0), torch.tensor(0)).item() == 0.0


def test_kto_robust_batches():
    """Batch of one, an empty shard, one class only: finite values, and the desirable-only / undesirable-only
    values are the same as inside a mixed batch (per-example loss, no per-batch normalisation)."""
    z0 = torch.tensor(0.2)
    for label in (True, False):
        one = kto_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([label]), z0, 0.1)
        assert one.shape == (1,) and torch.isfinite(one).all()
    empty = kto_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), z0, 0.1)
    assert empty.shape == (0,) and empty.sum().item() == 0.0
    pol, ref = torch.randn(5), torch.randn(5)
    y = torch.tensor([True, False, True, True, False])
    mixed = kto_loss(pol, ref, y, z0, 0.1)
    torch.testing.assert_close(kto_loss(pol[y], ref[y], y[y], z0, 0.1), mixed[y])
    torch.testing.assert_close(kto_loss(pol[~y], ref[~y], y[~y], z0, 0.1), mixed[~y])


def test_sharded_reduction_equals_whole_batch():
    """The recipe's reduction: z0 from KL sums and counts added over shards, then sum(losses) / N_global. Seven
    examples (odd) split 3 | 1 | 3 as desirable-only | undesirable-only | mixed shards give the same z0, loss and
    gradient as the whole batch: sum over shards of (shard sum / 7) = mean over 7."""
    g = torch.Generator().manual_seed(0)
    pol = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    ref, kl_pol, kl_ref = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    kl_pol = kl_pol + 1.0  # a positive KL estimate, so the clamp does not hide a wrong mean
    y = torch.tensor([True, True, True, False, True, False, True])
    z_whole = kl_reference_point((kl_pol - kl_ref).sum(), torch.tensor(7))
    whole = kto_loss(pol, ref, y, z_whole, 0.5, 1.3, 0.7).mean()
    (g_whole,) = torch.autograd.grad(whole, pol)

    shards = [[0, 1, 2], [3], [4, 5, 6]]
    assert all(y[s].all() for s in shards[:1]) and not y[shards[1]].any()
    kl_sum = sum((kl_pol[s] - kl_ref[s]).sum() for s in shards)
    z = kl_reference_point(kl_sum, torch.tensor(sum(len(s) for s in shards)))
    total = sum(kto_loss(pol[s], ref[s], y[s], z, 0.5, 1.3, 0.7).sum() / 7 for s in shards)
    (g_sharded,) = torch.autograd.grad(total, pol)
    torch.testing.assert_close(z, z_whole)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_sharded, g_whole)


# ---- Bradley-Terry (the reward model) -------------------------------------------------------------------------------


def test_bradley_terry_hand_values():
    """-log sigma(d) = log(1 + e^-d), d = r_w - r_l - m:
    (2, 0):  d = 2,  log(1 + e^-2) = log(1.135335) = 0.126928
    (0, 0):  d = 0,  log 2 = 0.693147
    (0, 1):  d = -1, log(1 + e^1) = log(3.718282) = 1.313262
    with margin 1 on (2, 0): d = 1, log(1 + e^-1) = log(1.367879) = 0.313262"""
    chosen, rejected = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), torch.tensor([0.126928, 0.693147, 1.313262]),
                               atol=1e-6, rtol=0)
    loss = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([0.313262, 0.693147, 1.313262]), atol=1e-6, rtol=0)


def test_centering_term_hand_values():
    """center 0.5: (1, -1) adds 0.5 * 0^2 = 0 to log(1 + e^-2) = 0.126928; (1, 1) adds 0.5 * 2^2 = 2 to log 2:
    2.693147. The gradient of the second in r_w: -sigma(-0) + 0.5 * 2 * (1 + 1) = -0.5 + 2 = 1.5."""
    chosen = torch.tensor([1.0, 1.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, torch.tensor([-1.0, 1.0]), center_coefficient=0.5)
    torch.testing.assert_close(loss.detach(), torch.tensor([0.126928, 2.693147]), atol=1e-6, rtol=0)
    loss.sum().backward()
    # first: -sigma(-2) + 0.5 * 2 * 0 = -0.119203
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.119203, 1.5]), atol=1e-6, rtol=0)
