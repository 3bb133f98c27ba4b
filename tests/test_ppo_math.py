"""PPO maths against values worked by hand: GAE, whitening, KL estimators and controllers, clipped losses, entropy,
and token-level reductions that do not depend on how a batch is split over ranks and micro-batches."""

import math

import pytest
import torch

from verl_kit.algos import (
    AdaptiveKLController,
    FixedKLController,
    clipped_surrogate,
    clipped_tokens,
    entropy_from_logits,
    gae,
    global_mean_share,
    kl_estimate,
    masked_moments,
    token_rewards,
    truncation_penalty,
    value_clipped,
    value_loss,
    whiten,
)
from verl_kit.data import logprobs_from_logits


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


def test_policy_loss_hand_values():
    """clip 0.2, ratio = exp(logp - old), loss = max(-A r, -A clip(r, 0.8, 1.2)):
    A=+1, r=1.5: max(-1.5, -1.2) = -1.2  clipped      A=-1, r=1.5: max(1.5, 1.2) = 1.5  not clipped
    A=+1, r=0.5: max(-0.5, -0.8) = -0.5  not clipped  A=-1, r=0.5: max(0.5, 0.8) = 0.8  clipped"""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    old = torch.zeros(4)
    logp = ratio.log()
    torch.testing.assert_close(clipped_surrogate(logp - old, adv, 0.2), torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    torch.testing.assert_close(clipped_tokens(logp - old, adv, 0.2), torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # the gradient of a clipped token is zero, of an unclipped one -A * r
    logp = logp.clone().requires_grad_(True)
    clipped_surrogate(logp - old, adv, 0.2).sum().backward()
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
    torch.testing.assert_close(value_loss(v, old, ret, 0.2), torch.tensor([0.32, 0.005, 0.32, 0.5]))
    torch.testing.assert_close(value_clipped(v, old, ret, 0.2), torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_entropy_and_logprobs():
    """logits [0, 0]: H = ln 2 = 0.693147. logits [0, ln 3]: p = [0.25, 0.75],
    H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335; log p(token 1) = ln 0.75 = -0.287682."""
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([0.693147, 0.562335]))
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([0, 1])),
                               torch.tensor([-0.693147, -0.287682]))


def test_token_mean_invariant_to_rank_and_microbatch_split():
    """10 tokens with per-token loss w * x_i. The gradient of the token mean is mean(x). Two ranks, each
    accumulating its micro-batches' global_mean_share, then averaged over ranks (what DDP/DeepSpeed do), give the same
    gradient for any split, including unequal token counts per rank."""
    x = torch.arange(1.0, 11.0, dtype=torch.float64)  # mean 5.5
    for splits in ([[0, 1, 2], [3, 4]], [[5, 6, 7, 8], [9]]), ([[0], [1, 2, 3, 4, 5, 6, 7]], [[8, 9]]):
        rank_grads = []
        for rank_chunks in splits:
            w = torch.zeros((), dtype=torch.float64, requires_grad=True)
            for chunk in rank_chunks:
                global_mean_share(w * x[chunk], 10, 2).backward()
            rank_grads.append(w.grad.item())
        assert sum(rank_grads) / 2 == pytest.approx(5.5)


def test_packed_response_logprobs_match_plain_forward(tiny_model_path):
    """The packed, block-masked forward with ResponseIndex scattering puts each response token's log-prob at
    (row, position) exactly where a plain per-sequence forward puts it; rows 2 and 3 share their prompt (laid out
    once, layout's shared_prefix)."""
    from verl_kit.models import load_causal_lm
    from verl_kit.train import actor_logits, pack_responses

    model = load_causal_lm(tiny_model_path).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [10, 11, 12, 13]]
    response = torch.tensor([[20, 21, 22, 0], [30, 31, 0, 0], [40, 41, 42, 43], [50, 51, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    out = torch.zeros(4, 4)
    with torch.no_grad():
        batch, ix = pack_responses(prompts, response, mask, [2, 0, 3, 1], 0, True, 64, True)
        assert batch.num_tokens == 3 + 3 + 2 + 2 + 4 + 4 + 2 + 1  # row 3 continues row 2's first 3 prompt tokens
        heads = []  # the LM head runs on the 11 positions that predict response tokens only
        hook = model.lm_head.register_forward_hook(lambda _, args, out: heads.append(tuple(out.shape[:-1])))
        out[ix.row, ix.pos] = logprobs_from_logits(actor_logits(model, batch, ix, 0.7), ix.targets)
        hook.remove()
        assert heads == [(1, 11)] == [(1, len(ix.targets))]
        for b in range(4):
            n = int(mask[b].sum())
            seq = torch.tensor(prompts[b] + response[b, :n].tolist())[None]
            logits = model(seq).logits[0, len(prompts[b]) - 1:-1] / 0.7
            torch.testing.assert_close(out[b, :n], logits.log_softmax(-1).gather(-1, seq[0, len(prompts[b]):, None])
                                       .squeeze(-1), atol=1e-5, rtol=1e-5)
            assert (out[b, n:] == 0).all()
