"""verl_kit.algos.advantages against values worked by hand: GAE (also over a multi-turn episode, skipping the
environment's tokens), whitening, the KL estimators and controllers, token rewards and the truncation penalty; GRPO's
group-relative advantages, RLOO and REINFORCE++-baseline."""

import math

import pytest
import torch

from verl_kit.algos import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    group_advantages,
    kl_estimate,
    masked_moments,
    outcome_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    token_rewards,
    truncation_penalty,
    whiten,
)


def test_gae_hand_values():
    """gamma = 0.9, lambda = 0.5, so gamma * lambda = 0.45.
    Row 0: rewards [0, 0, 1], values [0.5, 0.5, 0.5], all three tokens real.
      t=2: delta = 1 + 0.9*0 - 0.5 = 0.5                 A2 = 0.5
      t=1: delta = 0 + 0.9*0.5 - 0.5 = -0.05             A1 = -0.05 + 0.45*0.5 = 0.175
      t=0: delta = -0.05                                 A0 = -0.05 + 0.45*0.175 = 0.02875
    Row 1: rewards [0, 2, 9], values [1, 0, 7], mask [1, 1, 0]: the episode ends at t=1, so the 9 and the 7 of the
    padding position must not leak in.
      t=1: delta = 2 + 0.9*0 - 0 = 2                     A1 = 2
      t=0: delta = 0 + 0.9*0 - 1 = -1                    A0 = -1 + 0.45*2 = -0.1
    """
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.02875, 0.175, 0.5], [-0.1, 2.0, 0.0]]))


def _gae_reference(rewards, values, length, gamma, lam):
    """The textbook definition, term by term: A_t = sum_l (gamma*lam)^l delta_{t+l}, V past the end = 0."""
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < length else 0.0) - values[t] for t in range(length)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)]


def test_gae_matches_plain_loop():
    """Random rewards, values and lengths: gae() equals the explicit sum of discounted TD errors."""
    g = torch.Generator().manual_seed(0)
    B, R, gamma, lam = 5, 7, 0.97, 0.9
    rewards, values = torch.randn(B, R, generator=g, dtype=torch.float64), torch.randn(B, R, generator=g,
                                                                                       dtype=torch.float64)
    lengths = [7, 1, 4, 6, 3]
    mask = torch.arange(R)[None] < torch.tensor(lengths)[:, None]
    adv = gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        ref = _gae_reference(rewards[b].tolist(), values[b].tolist(), n, gamma, lam)
        torch.testing.assert_close(adv[b, :n], torch.tensor(ref, dtype=torch.float64))
        assert (adv[b, n:] == 0).all()


def test_whiten_hand_values_and_split_invariance():
    """x = [1, 2, 3, 4] (plus a masked 100): mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25,
    std = 1.118034, so x' = (x - 2.5) / 1.118034 = [-1.341641, -0.447214, 0.447214, 1.341641]. Moments summed over
    two shards (as all_reduce does) whiten exactly like the whole batch."""
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    moments = masked_moments(x, mask)
    assert moments == {"count": 4.0, "sum": 10.0, "sum_sq": 30.0}
    out = whiten(x, mask, moments)
    torch.testing.assert_close(out[mask], torch.tensor([-1.341641, -0.447214, 0.447214, 1.341641]), atol=1e-5,
                               rtol=0)
    assert out[0, 2] == 0
    a, b = masked_moments(x[:1], mask[:1]), masked_moments(x[1:], mask[1:])
    shards = {k: a[k] + b[k] for k in a}
    torch.testing.assert_close(whiten(x[1:], mask[1:], shards), out[1:])
    # shift_mean=False scales only: x' + mean
    torch.testing.assert_close(whiten(x, mask, moments, shift_mean=False)[mask], out[mask] + 2.5)


def test_kl_estimators():
    """pi = 0.5, ref = 0.25: k1 = log(0.5/0.25) = 0.693147; r = ref/pi = 0.5, k3 = (r - 1) - log r = -0.5 + 0.693147
    = 0.193147. pi = 0.25, ref = 0.5: k1 = -0.693147 (k1 may be negative); r = 2, k3 = 1 - 0.693147 = 0.306853."""
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.693147, -0.693147]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.193147, 0.306853]))
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k2")


def test_multi_turn_gae_skips_environment_tokens():
    """One episode: sampled, environment, sampled: mask [1, 0, 1], rewards [0, 5, 1], values [0.5, 9, 0.25].
    gamma = lambda = 0.5. t=2: delta = 1 - 0.25 = 0.75, A = 0.75. t=1 (environment) skipped: its reward 5 and value 9
    are ignored and A = 0. t=0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375, A = -0.375 + 0.25 * 0.75 = -0.1875.
    verl's test_multi_turn_compute_gae_advantage_return property also holds: the values and rewards at environment
    positions (here random) do not change anything. The score goes on the last sampled token (token_rewards)."""
    mask = torch.tensor([[True, False, True]])
    out = gae(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]), mask, 0.5, 0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.1875, 0.0, 0.75]]))
    rewards = torch.tensor([[0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 1.0, 0.0, 0.0]])
    m = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.0, 0.0, 4.0, 5.0, 6.0, 0.0, 0.0, 7.0, 9.0, 0.0, 0.0]])
    noisy = torch.where(m, values, torch.randn(values.shape) * 100)
    torch.testing.assert_close(gae(rewards + ~m * torch.randn(m.shape), noisy, m, 0.9, 0.7),
                               gae(rewards, values, m, 0.9, 0.7))
    scored = token_rewards(torch.tensor([2.0]), torch.zeros(1, 4), torch.tensor([[True, True, False, False]]), 0.1)
    torch.testing.assert_close(scored, torch.tensor([[0.0, 2.0, 0.0, 0.0]]))
    holes = token_rewards(torch.tensor([2.0]), torch.zeros(1, 4), torch.tensor([[True, False, True, False]]), 0.1)
    torch.testing.assert_close(holes, torch.tensor([[0.0, 0.0, 2.0, 0.0]]))


def test_token_rewards_and_truncation_penalty():
    """kl_coef 0.5: every real token gets -0.5 * kl, the last real token also the score.
    Row 0: kl [0.1, 0.2, 0.3], score 1 -> [-0.05, -0.1, -0.15 + 1 = 0.85].
    Row 1: kl [0.4, 0.5, 9 (padding)], score 2, length 2 -> [-0.2, -0.25 + 2 = 1.75, 0].
    Truncation penalty -1 on row 0 only: scores [1, 2] -> [0, 2]."""
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = token_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))
    pen = truncation_penalty(torch.tensor([1.0, 2.0]), torch.tensor([True, False]), -1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 2.0]))


def test_kl_controllers():
    """Adaptive (Ziegler et al. 2019): beta 0.1, target 6, horizon 10000, n = 256 sequences.
    KL 9:   e = clip(9/6 - 1, -0.2, 0.2) = 0.2    -> beta = 0.1 * (1 + 0.2 * 0.0256) = 0.100512
    KL 3:   e = clip(-0.5) = -0.2                 -> beta = 0.1 * (1 - 0.00512)     = 0.099488
    KL 6.6: e = 0.1                               -> beta = 0.1 * (1 + 0.00256)     = 0.100256
    The fixed controller never moves; both round-trip through state_dict (they are checkpointed)."""
    for kl, expected in [(9.0, 0.100512), (3.0, 0.099488), (6.6, 0.100256)]:
        ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
        ctl.update(kl, 256)
        assert ctl.value == pytest.approx(expected, rel=1e-9)
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 256)
    assert fixed.value == 0.1
    ctl2 = AdaptiveKLController(0.5, 6.0, 10000)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.value == ctl.value


# ---- group advantages (GRPO, RLOO, REINFORCE++-baseline) ------------------------------------------------------


def test_group_advantages_by_hand():
    """Two groups of 4. [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so +-0.5 / (0.57735 +
    1e-4) = +-0.86588. [2, 2, 2, 2]: all equal, 0. Unscaled (Dr. GRPO): +-0.5 and 0. Groups of 2: [1, 0] has std
    sqrt(2 * 0.25 / 1) = 0.70711, so +-0.5 / 0.70721 = +-0.70700."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = 0.5 / ((1.0 / 3.0) ** 0.5 + 1e-4)
    torch.testing.assert_close(group_advantages(scores, 4), torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    assert abs(a - 0.86588) < 1e-5
    torch.testing.assert_close(group_advantages(scores, 4, scale=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    b = 0.5 / (0.5 ** 0.5 + 1e-4)
    torch.testing.assert_close(group_advantages(scores, 2), torch.tensor([b, -b, -b, b, 0, 0, 0, 0]))
    assert abs(b - 0.70700) < 1e-5


def test_rloo_by_hand():
    """RLOO: score minus the mean of the other n - 1 of its group, not scaled.
    [1, 0, 0, 1] (n = 4): a 1 against (0 + 0 + 1) / 3 = 1/3 -> 2/3; a 0 against (1 + 0 + 1) / 3 = 2/3 -> -2/3
    (= n / (n - 1) * (s - mean) = 4/3 * +-0.5). [3, 1, 2, 2]: 3 - 5/3 = 4/3, 1 - 7/3 = -4/3, 2 - 2 = 0, 0.
    Groups of 2, [3, 1]: 3 - 1 = 2 and 1 - 3 = -2; GRPO's unscaled advantage is half that (+-1)."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    t = 2 / 3
    torch.testing.assert_close(rloo_advantages(scores, 4), torch.tensor([t, -t, -t, t, 4 / 3, -4 / 3, 0.0, 0.0]))
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 1.0]), 2), torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(group_advantages(torch.tensor([3.0, 1.0]), 2, scale=False), torch.tensor([1.0, -1.0]))


def test_reinforce_plus_plus_baseline_by_hand_and_split_invariant():
    """Groups of 2, scores [1, 0, 3, 3] -> centred [0.5, -0.5, 0, 0]; response lengths [1, 3, 2, 2], so over the
    8 tokens: sum 0.5 - 1.5 + 0 = -1, mean -0.125; sum of squares 0.25 + 0.75 = 1, E[x^2] = 0.125;
    variance 0.125 - 0.015625 = 0.109375, std 0.330719. Advantages (c - mean) / std:
    (0.5 + 0.125) / 0.330719 = 1.889822, (-0.5 + 0.125) / 0.330719 = -1.133893, 0.125 / 0.330719 = 0.377964 (x2).
    Each group on its own rank, the moments summed over both (as reduce_metrics does): the same advantages."""
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = torch.arange(3)[None] < torch.tensor([1, 3, 2, 2])[:, None]
    want = torch.tensor([1.889822, -1.133893, 0.377964, 0.377964])
    torch.testing.assert_close(reinforce_plus_plus_baseline_advantages(scores, 2, mask), want)

    def centred_moments(s, m):
        return masked_moments(group_advantages(s, 2, scale=False)[:, None].expand(m.shape), m)

    a, b = centred_moments(scores[:2], mask[:2]), centred_moments(scores[2:], mask[2:])
    total = {k: a[k] + b[k] for k in a}
    shards = [reinforce_plus_plus_baseline_advantages(scores[i:i + 2], 2, mask[i:i + 2], lambda m: total)
              for i in (0, 2)]
    torch.testing.assert_close(torch.cat(shards), want)


def test_outcome_advantages_put_each_estimators_values_on_every_row():
    """--advantage_estimator through one call (recipes/grpo.py): scores of 4 episodes in groups of 2, [1, 0, 3, 1];
    5 rows, episode 1 in two (an agent's per-call samples): rows [e0, e1, e1, e2, e3]. grpo unscaled: centred
    [0.5, -0.5, 1, -1] -> rows [0.5, -0.5, -0.5, 1, -1]; scaled by the groups' std (0.70711, 1.41421, + 1e-4);
    rloo: [1, -1, 2, -2] -> [1, -1, -1, 2, -2]; reinforce_plus_plus_baseline whitens the centred values over the rows'
    tokens (lengths 1 each here: over [0.5, -0.5, -0.5, 1, -1], mean -0.1, population std 0.73485)."""
    scores, episode = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 1, 1, 2, 3])
    mask = torch.ones(5, 1, dtype=torch.bool)
    torch.testing.assert_close(outcome_advantages("grpo", scores, 2, mask, episode, scale=False),
                               torch.tensor([0.5, -0.5, -0.5, 1.0, -1.0]))
    a, b = 0.5 / (0.5 ** 0.5 + 1e-4), 1.0 / (2 ** 0.5 + 1e-4)
    torch.testing.assert_close(outcome_advantages("grpo", scores, 2, mask, episode), torch.tensor([a, -a, -a, b, -b]))
    torch.testing.assert_close(outcome_advantages("rloo", scores, 2, mask, episode),
                               torch.tensor([1.0, -1.0, -1.0, 2.0, -2.0]))
    c = torch.tensor([0.5, -0.5, -0.5, 1.0, -1.0])
    torch.testing.assert_close(outcome_advantages("reinforce_plus_plus_baseline", scores, 2, mask, episode),
                               (c + 0.1) / c.var(unbiased=False).sqrt())
    with pytest.raises(ValueError, match="'ppo'"):
        outcome_advantages("ppo", scores, 2, mask, episode)
