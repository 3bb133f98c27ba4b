"""Off-policy correction against values worked by hand: TRL 1.16's four vllm_importance_sampling_mode values, the
bounds at their boundary, the per-sequence product on packed, unsorted tokens, and the mismatch metrics."""

import math

import pytest
import torch

from verl_kit.algos import MODES, clipped_surrogate, importance_weights, mismatch_metrics, step_metrics
from verl_kit.train import Tally

# Four tokens of one sequence each, as (trainer probability, engine probability) -> ratio pi_old / mu:
#   (0.4, 0.8) -> 0.5    (0.6, 0.4) -> 1.5    (0.5, 0.2) -> 2.5    (0.8, 0.2) -> 4.0
TOKEN_OLD = torch.tensor([0.4, 0.6, 0.5, 0.8]).log()
TOKEN_SAMPLING = torch.tensor([0.8, 0.4, 0.2, 0.2]).log()
TOKEN_SEQ = torch.arange(4)

# Seven tokens of three sequences, packed out of order (sequence 3 has no token here, as when seq_index is the row
# of a rollout batch of 4 and the micro-batch holds three of them):
#   token   0     1     2     3     4     5     6
#   seq     1     0     2     0     1     2     0
#   trainer 0.8   0.6   0.2   0.35  0.5   0.4   0.9
#   engine  0.2   0.3   0.4   0.7   0.4   0.5   0.6
#   ratio   4     2     0.5   0.5   1.25  0.8   1.5
# Sequence ratios, the product of their tokens': seq 0 = 2 * 0.5 * 1.5 = 1.5, seq 1 = 4 * 1.25 = 5,
# seq 2 = 0.5 * 0.8 = 0.4.
PACKED_SEQ = torch.tensor([1, 0, 2, 0, 1, 2, 0])
PACKED_OLD = torch.tensor([0.8, 0.6, 0.2, 0.35, 0.5, 0.4, 0.9]).log()
PACKED_SAMPLING = torch.tensor([0.2, 0.3, 0.4, 0.7, 0.4, 0.5, 0.6]).log()


def test_token_modes_hand_values():
    """Ratios [0.5, 1.5, 2.5, 4], C_max = 3 (TRL's default):
      token_truncate  clamp at 3            -> [0.5, 1.5, 2.5, 3]
      token_mask      0 where above 3       -> [0.5, 1.5, 2.5, 0]
    With C_min = 0.6 as well:
      token_truncate  clamp to [0.6, 3]     -> [0.6, 1.5, 2.5, 3]
      token_mask      0 outside [0.6, 3]    -> [0,   1.5, 2.5, 0]"""
    w = lambda mode, **kw: importance_weights(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, mode, **kw)
    torch.testing.assert_close(w("token_truncate"), torch.tensor([0.5, 1.5, 2.5, 3.0]))
    torch.testing.assert_close(w("token_mask"), torch.tensor([0.5, 1.5, 2.5, 0.0]))
    torch.testing.assert_close(w("token_truncate", clip_min=0.6), torch.tensor([0.6, 1.5, 2.5, 3.0]))
    torch.testing.assert_close(w("token_mask", clip_min=0.6), torch.tensor([0.0, 1.5, 2.5, 0.0]))
    # without an upper bound only C_min acts
    torch.testing.assert_close(w("token_mask", clip_max=None, clip_min=0.6), torch.tensor([0.0, 1.5, 2.5, 4.0]))


def test_sequence_modes_on_packed_unsorted_tokens():
    """Sequence ratios 1.5 (seq 0), 5 (seq 1), 0.4 (seq 2), broadcast to tokens by seq_index [1, 0, 2, 0, 1, 2, 0]:
      sequence_truncate, C_max 3   seq 1 -> 3      [3, 1.5, 0.4, 1.5, 3, 0.4, 1.5]
      sequence_mask, C_max 3       seq 1 -> 0      [0, 1.5, 0.4, 1.5, 0, 0.4, 1.5]
      ... and C_min 0.5            seq 2 -> 0.5 (truncate) or 0 (mask)
    The sequence ratio is a product, not a geometric mean: seq 1's geometric mean sqrt(5) = 2.236 is below 3 and
    would be kept. Per token, token_truncate gives [3, 2, 0.5, 0.5, 1.25, 0.8, 1.5] on the same tokens."""
    w = lambda mode, **kw: importance_weights(PACKED_OLD, PACKED_SAMPLING, PACKED_SEQ, 4, mode, **kw)
    torch.testing.assert_close(w("sequence_truncate"), torch.tensor([3.0, 1.5, 0.4, 1.5, 3.0, 0.4, 1.5]))
    torch.testing.assert_close(w("sequence_mask"), torch.tensor([0.0, 1.5, 0.4, 1.5, 0.0, 0.4, 1.5]))
    torch.testing.assert_close(w("sequence_truncate", clip_min=0.5), torch.tensor([3.0, 1.5, 0.5, 1.5, 3.0, 0.5, 1.5]))
    torch.testing.assert_close(w("sequence_mask", clip_min=0.5), torch.tensor([0.0, 1.5, 0.0, 1.5, 0.0, 0.0, 1.5]))
    torch.testing.assert_close(w("token_truncate"), torch.tensor([3.0, 2.0, 0.5, 0.5, 1.25, 0.8, 1.5]))
    # the default mode is TRL's: sequence_mask with C_max 3
    torch.testing.assert_close(importance_weights(PACKED_OLD, PACKED_SAMPLING, PACKED_SEQ, 4), w("sequence_mask"))
    # the order of the tokens does not matter: permuting the inputs permutes the weights
    perm = torch.tensor([6, 2, 4, 0, 5, 1, 3])
    for mode in MODES:
        torch.testing.assert_close(
            importance_weights(PACKED_OLD[perm], PACKED_SAMPLING[perm], PACKED_SEQ[perm], 4, mode), w(mode)[perm])


def test_bounds_are_inclusive():
    """A ratio equal to a bound is kept as it is; just past it, it is cut. Log-ratios 0 and +-1e-3 give ratios
    1 (exactly) and 1.001 / 0.999.
      C_max = 1:  ratio 1 kept by mask and truncate; 1.001 -> 0 (mask), 1 (truncate)
      C_min = 1:  ratio 1 kept; 0.999 -> 0 (mask), 1 (truncate)"""
    sampling = torch.full((2,), -1.0)
    up, down = torch.tensor([-1.0, -0.999]), torch.tensor([-1.0, -1.001])
    seq = torch.arange(2)
    torch.testing.assert_close(importance_weights(up, sampling, seq, 2, "token_mask", clip_max=1.0),
                               torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(importance_weights(up, sampling, seq, 2, "token_truncate", clip_max=1.0),
                               torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(importance_weights(down, sampling, seq, 2, "token_mask", clip_max=None, clip_min=1.0),
                               torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(
        importance_weights(down, sampling, seq, 2, "token_truncate", clip_max=None, clip_min=1.0),
        torch.tensor([1.0, 1.0]))
    m = mismatch_metrics(up, sampling, seq, 2, "token_truncate", clip_max=1.0)
    torch.testing.assert_close(m["is_clipped"], torch.tensor([0.0, 1.0]))


def test_weights_are_one_when_engine_and_trainer_agree():
    """old == sampling: every ratio is exp(0) = 1, in every mode, however long the sequence; a NaN engine log-prob
    (a token vLLM could not score) means no correction: ratio 1, and it adds nothing to its sequence's log-ratio."""
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(50, generator=g) * 5
    seq = torch.randint(0, 6, (50,), generator=g)
    for mode in MODES:
        torch.testing.assert_close(importance_weights(logps, logps.clone(), seq, 6, mode), torch.ones(50))
    sampling = TOKEN_SAMPLING.clone()
    sampling[1] = float("nan")
    torch.testing.assert_close(importance_weights(TOKEN_OLD, sampling, TOKEN_SEQ, 4, "token_mask"),
                               torch.tensor([0.5, 1.0, 2.5, 0.0]))
    # one sequence of the four tokens, the second unscored: 0.5 * 2.5 * 4 = 5 -> truncated to 3
    torch.testing.assert_close(importance_weights(TOKEN_OLD, sampling, torch.zeros(4, dtype=torch.long), 1,
                                                  "sequence_truncate", clip_max=6.0), torch.full((4,), 5.0))


def test_weights_are_detached_and_scale_the_policy_gradient():
    """The weight is a constant: no graph through old_logprobs. Multiplying the per-token loss by it scales each
    token's gradient by it. clip 0.2, logprobs = old (ratio 1, unclipped), A = [1, -1, 2, 1]: the gradient of
    clipped_surrogate is -A * 1 = [-1, 1, -2, -1]; with weights [0.5, 1.5, 2.5, 3] it is [-0.5, 1.5, -5, -3]."""
    old = TOKEN_OLD.clone().requires_grad_(True)
    w = importance_weights(old, TOKEN_SAMPLING, TOKEN_SEQ, 4, "token_truncate")
    assert not w.requires_grad and w.grad_fn is None
    logprobs = TOKEN_OLD.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    (clipped_surrogate(logprobs, logprobs - TOKEN_OLD, adv, 0.2).loss * w).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 1.5, -5.0, -3.0]))
    assert old.grad is None


def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode 'token_clip'.*sequence_mask"):
        importance_weights(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, "token_clip")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        mismatch_metrics(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, "sequence")
    with pytest.raises(ValueError, match="clip_max or"):
        importance_weights(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, "token_truncate", clip_max=None)
    with pytest.raises(ValueError, match="must be less than"):
        importance_weights(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, "token_mask", clip_max=2.0, clip_min=2.0)
    # mask modes with no bound at all are plain IS, as in TRL
    torch.testing.assert_close(importance_weights(TOKEN_OLD, TOKEN_SAMPLING, TOKEN_SEQ, 4, "token_mask",
                                                  clip_max=None), torch.tensor([0.5, 1.5, 2.5, 4.0]))


def test_mismatch_metrics_hand_values():
    """Ratios r = [0.5, 1.5, 4] on three scored tokens plus a fourth the engine did not score (NaN), token_truncate,
    C_max 3.
      |d| = |ln r|                  [0.693147, 0.405465, 1.386294, 0]     sum 2.484907, max 1.386294
      k3 = r - 1 - ln r             [0.5 - 1 + 0.693147 = 0.193147,
                                     1.5 - 1 - 0.405465 = 0.094535,
                                     4 - 1 - 1.386294 = 1.613706, 0]      sum 1.901388
      mismatch_tokens               [1, 1, 1, 0]                          sum 3
      so sampling_logp_diff mean 2.484907 / 3 = 0.828302, mismatch_kl 1.901388 / 3 = 0.633796
      is_ratio (the unscored token gets 1)  [0.5, 1.5, 3, 1]  mean 6 / 4 = 1.5, min 0.5, max 3
      is_clipped                    [0, 0, 1, 0]                          fraction 1 / 4"""
    old = torch.tensor([0.4, 0.6, 0.8, 0.5]).log()
    sampling = torch.tensor([0.8, 0.4, 0.2, float("nan")]).log()
    m = mismatch_metrics(old, sampling, torch.arange(4), 4, "token_truncate")
    assert set(m) == {"is_tokens", "mismatch_tokens", "mismatch_kl", "sampling_logp_diff", "is_ratio", "is_clipped"}
    assert all(v.shape == (4,) and not v.requires_grad for v in m.values())
    torch.testing.assert_close(m["mismatch_tokens"], torch.tensor([1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(m["sampling_logp_diff"], torch.tensor([0.693147, 0.405465, 1.386294, 0.0]))
    torch.testing.assert_close(m["mismatch_kl"], torch.tensor([0.193147, 0.094535, 1.613706, 0.0]))
    torch.testing.assert_close(m["is_ratio"], torch.tensor([0.5, 1.5, 3.0, 1.0]))
    torch.testing.assert_close(m["is_clipped"], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    tally = Tally()
    tally.add(tokens=4, **m)
    t = tally.reduce()
    assert t["sampling_logp_diff"] / t["mismatch_tokens"] == pytest.approx(0.828302, abs=1e-5)
    assert t["mismatch_kl"] / t["mismatch_tokens"] == pytest.approx(0.633796, abs=1e-5)
    assert t["is_ratio"] / t["tokens"] == pytest.approx(1.5)
    assert t["is_clipped"] / t["tokens"] == pytest.approx(0.25)
    assert float(m["sampling_logp_diff"].max()) == pytest.approx(math.log(4))


def test_step_metrics_divide_each_sum_by_its_own_count():
    """One sequence, old = [-1, -1, -1, -1], sampling = [-1.5, nan, nan, -0.5], token_truncate (C_max 3):
      d = old - sampling = [0.5, 0 (unscored), 0 (unscored), -0.5]
      is_ratio = exp(d) = [1.648721, 1, 1, 0.606531], sum 4.255252 over 4 tokens: mean 1.063813
      (dividing by the 2 scored tokens, as before, logged 2.127626)
      is_clipped = [0, 0, 0, 0]: 0 / 4
      |d| over the 2 scored tokens: (0.5 + 0.5) / 2 = 0.5
      k3 = r - 1 - ln r: 1.648721 - 1 - 0.5 = 0.148721 and 0.606531 - 1 + 0.5 = 0.106531, mean 0.127626"""
    old = torch.full((4,), -1.0)
    sampling = torch.tensor([-1.5, float("nan"), float("nan"), -0.5])
    tally = Tally()
    tally.add(**mismatch_metrics(old, sampling, torch.zeros(4, dtype=torch.long), 1, "token_truncate"))
    m = step_metrics(tally.reduce())
    assert m["rollout/is_ratio_mean"] == pytest.approx(1.063813, abs=1e-6)
    assert m["rollout/is_clipped_frac"] == 0.0
    assert m["rollout/logp_diff_mean"] == pytest.approx(0.5, abs=1e-6)
    assert m["rollout/mismatch_kl"] == pytest.approx(0.127626, abs=1e-6)
    assert step_metrics(Tally().reduce()) == {}  # no correction this step: no metrics


def test_mismatch_metrics_sequence_mode_and_micro_batch_sums():
    """The packed example in sequence_mask, C_max 3: seq 1 (ratio 5; tokens 0 and 4) is masked, so is_ratio is
    [0, 1.5, 0.4, 1.5, 0, 0.4, 1.5] (token mean 5.3 / 7) and is_clipped [1, 0, 0, 0, 1, 0, 0] (2 / 7). Summed over
    two micro-batches, each holding whole sequences (seqs 0 and 2; seq 1), the tallies equal the whole batch's."""
    whole = mismatch_metrics(PACKED_OLD, PACKED_SAMPLING, PACKED_SEQ, 4, "sequence_mask")
    torch.testing.assert_close(whole["is_ratio"], torch.tensor([0.0, 1.5, 0.4, 1.5, 0.0, 0.4, 1.5]))
    torch.testing.assert_close(whole["is_clipped"], torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))
    one, parts = Tally(), Tally()
    one.add(**whole)
    for chunk in (PACKED_SEQ != 1, PACKED_SEQ == 1):
        parts.add(**mismatch_metrics(PACKED_OLD[chunk], PACKED_SAMPLING[chunk], PACKED_SEQ[chunk], 4,
                                     "sequence_mask"))
    assert parts.sums == pytest.approx(one.sums)
    assert one.sums["is_ratio"] == pytest.approx(5.3)


def _padded_reference(old, sampling, mask, mode, clip_max):
    """The same correction written on padded (B, T) tensors the way GRPOTrainer holds them: the log-ratio is zeroed
    on padding, summed over T for the sequence modes, then exp, then the bound."""
    diff = (old - sampling) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=clip_max).expand_as(old)
    return ratio.masked_fill(ratio > clip_max, 0.0).expand_as(old)


def test_flat_tokens_match_padded_batch():
    """Random right-padded batch of 5 responses, lengths [7, 1, 4, 6, 3]: the weights on the flattened scored tokens
    equal those of the padded (B, T) formulation at the same positions, in all four modes."""
    g = torch.Generator().manual_seed(1)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g) * 3
    sampling = old + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.arange(T)[None] < torch.tensor([7, 1, 4, 6, 3])[:, None]
    seq = torch.arange(B)[:, None].expand(B, T)[mask]
    for mode in MODES:
        ref = _padded_reference(old, sampling, mask.float(), mode, 1.5)[mask]
        torch.testing.assert_close(importance_weights(old[mask], sampling[mask], seq, B, mode, clip_max=1.5), ref)
