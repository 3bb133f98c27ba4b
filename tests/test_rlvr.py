"""RLVR variants of the online recipes against values worked by hand: clip-higher, GSPO's sequence-level ratio and
CISPO (and the same values and gradients as TRL 1.16's GRPOTrainer._compute_loss written out on padded tensors),
RLOO and REINFORCE++-baseline advantages, truncated responses masked out of the reduction, DAPO's soft overlong
punishment (and TRL's own function), the unbiased pass@k; the flags' one-line errors; one short GRPO run with them."""

import math

import pytest
import torch
from helpers import metrics, recipe_cmd, run

from verl_kit.algos import (
    cispo_clipped,
    cispo_loss,
    clipped_surrogate,
    clipped_tokens,
    group_advantages,
    group_rows,
    informative_groups,
    loss_weights,
    masked_moments,
    pass_at_k,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    select_groups,
    sequence_log_ratio,
)
from verl_kit.errors import UserError
from verl_kit.rewards.functions import call_reward_fn, get_soft_overlong_punishment, soft_overlong_punishment
from verl_kit.rollout import Prompts, Rollout, Rollouts, SamplingParams, Scores, dynamic_sampling

TINY = "recipes/configs/grpo_tiny.yaml"


# ---- policy losses -------------------------------------------------------------------------------------------------


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
    sym = clipped_surrogate(log_r, A, 0.2)
    torch.testing.assert_close(sym, torch.tensor([-1.2, 1.3, -0.7, 0.8, -1.2], dtype=torch.float64))
    assert clipped_tokens(log_r, A, 0.2).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    high = clipped_surrogate(log_r, A, 0.2, 0.28)
    torch.testing.assert_close(high, torch.tensor([-1.28, 1.3, -0.7, 0.8, -1.25], dtype=torch.float64))
    assert clipped_tokens(log_r, A, 0.2, 0.28).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
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
    torch.testing.assert_close(clipped_surrogate(lr, A, 0.2), torch.tensor([-1.2, 0.8, -1.2], dtype=torch.float64))
    torch.testing.assert_close(clipped_surrogate(lr, A, 0.2, 0.28),
                               torch.tensor([-1.221403, 0.8, -1.221403], dtype=torch.float64), atol=1e-6, rtol=0)
    assert clipped_tokens(lr, A, 0.2).tolist() == [1.0, 1.0, 1.0]


def test_cispo_by_hand():
    """log pi = [ln 0.5, ln 0.25, ln 0.5], ratios r = [2, 8, 8], A = [1, 1, -1], cap 5: weights min(r, 5) = [2, 5, 5],
    detached. Loss -w A log pi = [-2 ln 0.5, -5 ln 0.25, 5 ln 0.5] = [1.386294, 6.931472, -3.465736]; its gradient
    with respect to log pi is -w A = [-2, -5, 5] (no token is cut, however far its ratio moved). The capped-weight
    metric counts r > cap with A > 0 only (TRL's cispo_clip_ratio): [0, 1, 0]."""
    logp = torch.tensor([0.5, 0.25, 0.5], dtype=torch.float64).log().requires_grad_()
    log_r = torch.tensor([2.0, 8.0, 8.0], dtype=torch.float64).log()
    A = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss = cispo_loss(logp, log_r, A, 5.0)
    torch.testing.assert_close(loss, torch.tensor([1.386294, 6.931472, -3.465736], dtype=torch.float64), atol=1e-6,
                               rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([-2.0, -5.0, 5.0], dtype=torch.float64))
    assert cispo_clipped(log_r, A, 5.0).tolist() == [0.0, 1.0, 0.0]


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
    return (per_token_loss * mask).sum() / mask.sum()  # dapo, cispo: one process, one micro-batch


@pytest.mark.parametrize("level,loss_type", [("token", "dapo"), ("sequence", "dapo"), ("sequence", "grpo"),
                                             ("token", "cispo"), ("sequence", "cispo")])
def test_losses_match_trl_formula(level, loss_type):
    """Same small inputs through TRL's formula on padded tensors and through the kit's flattened tokens with
    loss_weights: equal loss and equal gradient with respect to every log-prob, for clip-higher (eps 0.2,
    eps_high 0.28), GSPO and CISPO (cap 1.3, so some weights are capped)."""
    mask, logp, old, adv, seq = _padded()
    eps, eps_high = 0.2, (1.3 if loss_type == "cispo" else 0.28)
    lp = logp.clone().requires_grad_()
    want = _trl_loss(lp, old, adv, mask, level, loss_type, eps, eps_high)
    (want_grad,) = torch.autograd.grad(want, lp)

    flat = logp[mask].clone().requires_grad_()
    o, a = old[mask], adv[seq]
    log_ratio = sequence_log_ratio(flat, o, seq, 3) if level == "sequence" else flat - o
    loss = (cispo_loss(flat, log_ratio, a, eps_high) if loss_type == "cispo"
            else clipped_surrogate(log_ratio, a, eps, eps_high))
    lengths = mask.sum(-1)[seq]
    w = loss_weights(loss_type, lengths, float(mask.sum()), 3.0, 4)
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
    w = loss_weights("grpo", mask.sum(-1)[seq], float(mask.sum()), 3.0, 4)
    ours = flat.clone().requires_grad_()
    lr = sequence_log_ratio(ours, o, seq, 3)
    (g_ours,) = torch.autograd.grad((clipped_surrogate(lr, a, 0.2, 0.28) * w).sum(), ours)
    theirs = flat.clone().requires_grad_()
    seq_mean = sequence_log_ratio(theirs, o, seq, 3).detach()
    lr_verl = theirs - theirs.detach() + seq_mean
    torch.testing.assert_close(lr_verl, lr.detach())
    (g_verl,) = torch.autograd.grad((clipped_surrogate(lr_verl, a, 0.2, 0.28) * w).sum(), theirs)
    torch.testing.assert_close(g_ours, g_verl)


# ---- advantages ----------------------------------------------------------------------------------------------------


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


# ---- truncated responses out of the reduction ----------------------------------------------------------------------


def test_mask_truncated_reduction_by_hand_and_split_invariant():
    """Three responses with per-token losses [4], [1, 2, 3] (truncated), [5, 7]. The recipe's rule: weights
    loss_weights(...) * keep, with the token and response counts over kept responses only.
      dapo: (4 + 5 + 7) / 3 kept tokens = 5.333333      grpo: (4 / 1 + 12 / 2) / 2 kept responses = 5.0
    The same when rank 0 holds responses 0 and 1 and rank 1 holds response 2 (shares times world = 2, averaged).
    All truncated: the counts are 0, the weights 0 and finite (the counts are clamped to 1), the loss 0."""
    loss = torch.tensor([4.0, 1.0, 2.0, 3.0, 5.0, 7.0])
    row = torch.tensor([0, 1, 1, 1, 2, 2])
    lengths, keep = torch.tensor([1, 3, 2]), torch.tensor([True, False, True])
    tokens, seqs = float(lengths[keep].sum()), float(keep.sum())
    for kind, want in (("dapo", 16 / 3), ("grpo", 5.0)):
        w = loss_weights(kind, lengths[row], max(tokens, 1), max(seqs, 1), 4) * keep[row]
        assert float((loss * w).sum()) == pytest.approx(want)
        shares = [float((loss[r] * w[r]).sum()) * 2 for r in (row < 2, row == 2)]
        assert sum(shares) / 2 == pytest.approx(want)
    none = torch.zeros(3, dtype=torch.bool)
    w = loss_weights("dapo", lengths[row], max(0.0, 1), max(0.0, 1), 4) * none[row]
    assert torch.isfinite(w).all() and float((loss * w).sum()) == 0.0


# ---- rewards and evaluation ----------------------------------------------------------------------------------------


def test_soft_overlong_punishment_by_hand_and_like_trl():
    """L_max = 10, L_cache = 4: lengths up to 6 score 0; 7 -> (6 - 7) / 4 = -0.25; 9 -> -0.75; 10 -> -1.0; 11 -> -1
    (past L_max). TRL's get_soft_overlong_punishment gives the same on the same ids. Called through the kit's reward
    convention (call_reward_fn, completion_ids by keyword). The ready-made function has TRL's command-line values."""
    from trl.rewards import get_soft_overlong_punishment as trl_factory

    ids = [[1] * n for n in (3, 6, 7, 9, 10, 11)]
    want = [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    fn = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    got = call_reward_fn("overlong", fn, ["p"] * 6, ["c"] * 6, {"answer": list(range(6))}, ids)
    assert got.tolist() == want
    assert trl_factory(10, 4)(ids) == want
    assert (soft_overlong_punishment.max_completion_len, soft_overlong_punishment.soft_punish_cache) == (1280, 256)
    with pytest.raises(UserError, match="soft_punish_cache 0"):
        get_soft_overlong_punishment(10, 0)


def test_pass_at_k_by_hand():
    """n = 4 samples, c = [0, 1, 2, 4] passed. pass@1 = c / n = [0, 0.25, 0.5, 1].
    pass@2 = 1 - C(4 - c, 2) / C(4, 2), C(4, 2) = 6: c=0 -> 1 - 6/6 = 0; c=1 -> 1 - 3/6 = 0.5; c=2 -> 1 - 1/6 =
    0.833333; c=4 -> C(0, 2) = 0 -> 1. pass@4: any pass among all four -> [0, 1, 1, 1]. And against math.comb on every
    (n, c, k) up to n = 9."""
    c = torch.tensor([0, 1, 2, 4])
    torch.testing.assert_close(pass_at_k(c, 4, 1), torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(c, 4, 2), torch.tensor([0.0, 0.5, 5 / 6, 1.0], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(c, 4, 4), torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    for n in range(1, 10):
        for k in range(1, n + 1):
            cs = torch.arange(n + 1)
            want = [1 - math.comb(n - int(x), k) / math.comb(n, k) for x in cs]
            torch.testing.assert_close(pass_at_k(cs, n, k), torch.tensor(want, dtype=torch.float64))
    with pytest.raises(ValueError, match="pass@5 of 4"):
        pass_at_k(c, 4, 5)


# ---- flags ---------------------------------------------------------------------------------------------------------


# ---- dynamic sampling (DAPO) ---------------------------------------------------------------------------------------


def test_informative_groups_and_selection_by_hand():
    """Groups of 2 (float64): [1, 1] flat; [0, 1] informative; [0.5, 0.5 + 1e-12] informative (exact equality: the
    difference is tiny but real, and the advantages use it); [0.0, -0.0] flat (equal numbers); [3, 3] flat.
    Selection from informative = [F, T, T, F, F] for a step of target 2: take 2 -> groups [1, 2], rows [2, 3, 4, 5];
    take 1 (the fewest any process found) -> [1]; take 0 (some process found none) -> the first batch's groups
    [0, 1] as they are."""
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-12, 0.0, -0.0, 3.0, 3.0], dtype=torch.float64)
    informative = informative_groups(scores, 2)
    assert informative.tolist() == [False, True, True, False, False]
    assert select_groups(informative, 2, 2).tolist() == [1, 2]
    assert group_rows(select_groups(informative, 2, 2), 2).tolist() == [2, 3, 4, 5]
    assert select_groups(informative, 2, 1).tolist() == [1]
    assert select_groups(informative, 2, 0).tolist() == [0, 1]
    with pytest.raises(ValueError, match="only 2 informative"):
        select_groups(informative, 3, 3)


class PromptEchoEngine:
    """Answers prompt [i] with n responses of the one token i: the scores below then follow the prompt."""

    per_sample_seeds = False

    def generate(self, prompts, params):
        B = len(prompts) * params.n
        ids = torch.tensor([[p[0]] for p in prompts for _ in range(params.n)])
        return Rollout([p for p in prompts for _ in range(params.n)], ids, torch.ones(B, 1, dtype=torch.bool),
                       torch.zeros(B, 1), torch.zeros(B, dtype=torch.bool))

    def load_weights(self, actor, version=0):
        return {}

    def close(self):
        pass


@pytest.mark.parametrize("ahead", [None, 1])
@pytest.mark.parametrize("flat,cap,prompts,batches,kept", [
    ({0, 2, 3}, 10, [1, 1, 4, 4], 3, 2),   # batch 0: prompt 1; batch 1: none; batch 2: prompt 4 -> full
    ({0, 2, 3}, 2, [1, 1], 2, 1),          # the cap: 2 batches found 1 of 2 -> trains on that one (and warns)
    ({0, 1, 2, 3}, 2, [0, 0, 1, 1], 2, 0),  # none found: the first batch as it is
])
def test_dynamic_sampling_refills_flat_groups_up_to_the_cap(flat, cap, prompts, batches, kept, ahead):
    """Two prompts per batch (batch k of step 0 asks prompts 2k and 2k + 1), groups of 2; a flat prompt's responses
    both score 1, another's score [0, 1]. The step's batch is refilled with the informative groups in generation
    order, at most `cap` batches, and the metrics count batches, groups generated and kept. The same with the
    rollout thread generating a step ahead (--async_rollout): the further batches queue behind step 1's."""
    def request(step, k):
        return [2 * k, 2 * k + 1], SamplingParams(n=2)

    def score(ro):
        return Scores(torch.tensor([1.0 if i in flat else float(j % 2) for j, i in enumerate(ro.prompt_index)]))

    split = Prompts([{}] * 20, [[i] for i in range(20)])  # prompt i is [i]
    rollouts = Rollouts(PromptEchoEngine(), split, request, total_steps=2, max_staleness=ahead)
    first, _ = rollouts.get(0)
    ro, scores, m = dynamic_sampling(rollouts, 0, first, score(first), score, 2, cap)
    rollouts.close()
    assert ro.prompt_index == prompts and ro.response_ids.flatten().tolist() == prompts
    torch.testing.assert_close(scores.total, score(ro).total)
    assert m == {"rollout/gen_batches": batches, "rollout/groups_generated": 2 * batches, "rollout/groups_kept": kept}


# ---- the recipe ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_variants_run(tmp_path):
    """Two GRPO steps on the tiny model with RLOO advantages, GSPO's sequence-level ratio, clip-higher, truncated
    responses masked out of the loss, and 4 held-out samples per prompt (a response passes at reward >= 0.25, one
    kind word): finite losses and metrics, a zero gradient on a step whose responses are all truncated (step 1 here),
    eval/pass@1 <= pass@2 <= pass@4 in [0, 1] and no pass@8."""
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--config", TINY, "--output_dir", str(out), "--max_steps", "2", "--logging_steps",
                               "1", "--advantage_estimator", "rloo", "--importance_sampling_level", "sequence",
                               "--epsilon_high", "0.28", "--mask_truncated_completions", "--num_generations_eval",
                               "4", "--pass_threshold", "0.25"]), timeout=300)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/pg_clipfrac", "grad_norm", "kl"))
    # the random model ends no response of step 1 with EOS: all are masked, so no gradient (and no NaN from the
    # empty counts); step 2 has a few that end and trains on them
    assert rows[1]["response_length/clip_ratio"] == 1.0 and rows[1]["grad_norm"] == 0.0, rows[1]
    assert rows[2]["response_length/clip_ratio"] < 1.0 and rows[2]["grad_norm"] > 0.0, rows[2]
    for r in (rows[0], rows[-1]):
        p = [r[f"eval/pass@{k}"] for k in (1, 2, 4)]
        assert 0.0 <= p[0] <= p[1] <= p[2] <= 1.0, r
        assert "eval/pass@8" not in r
    assert (out / "final" / "model.safetensors").is_file()
