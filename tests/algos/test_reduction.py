"""verl_kit.algos.reduction by hand: the loss weights of every reduction (also with truncated responses masked out of
the reduction) and the token mean, each the same however a batch is split over ranks and micro-batches."""

import inspect

import pytest
import torch

from verl_kit.algos import POLICY_LOSSES, REDUCTIONS, global_mean_share, loss_weights, reduction


def test_loss_weights_by_hand_and_split_invariant():
    """Two responses of 1 and 3 tokens with per-token losses [4] and [1, 2, 3], max_len 4.
    token:    (4 + 1 + 2 + 3) / 4 tokens = 2.5
    sequence: (4 / 1 + 6 / 3) / 2 responses = 3.0
    constant: (4 + 1 + 2 + 3) / (2 responses * 4) = 1.25
    and the same sums when the 4 tokens are split over 2 ranks and micro-batches (each rank's share times world=2,
    then averaged over ranks, as DDP/DeepSpeed do)."""
    loss = torch.tensor([4.0, 1.0, 2.0, 3.0])
    row_len = torch.tensor([1, 3, 3, 3])
    cases = (("token", 2.5), ("sequence", 3.0), ("constant", 1.25))
    for kind, want in cases:
        w = loss_weights(kind, row_len, global_tokens=4, global_seqs=2, max_len=4)
        assert float((loss * w).sum()) == pytest.approx(want)
        ranks = [[[0], [1]], [[2, 3]]]  # rank 0: two micro-batches, rank 1: one
        shares = [sum(float((loss[c] * w[c]).sum()) * 2 for c in chunks) for chunks in ranks]
        assert sum(shares) / 2 == pytest.approx(want)
    with pytest.raises(ValueError, match="reduction 'mean': choose one of token, sequence, constant"):
        loss_weights("mean", row_len, 4, 2, 4)
    assert {kind for kind, _ in cases} == set(REDUCTIONS)


def test_reduction_knows_no_loss_names():
    """A policy loss declares its reduction beside itself (algos.policy.POLICY_LOSSES): reduction.py names none of
    them, so adding a loss does not touch it."""
    source = inspect.getsource(reduction).lower()
    assert [name for name in POLICY_LOSSES if name in source] == []


def test_mask_truncated_reduction_by_hand_and_split_invariant():
    """Three responses with per-token losses [4], [1, 2, 3] (truncated), [5, 7]. The recipe's rule: weights
    loss_weights(...) * keep, with the token and response counts over kept responses only.
      token: (4 + 5 + 7) / 3 kept tokens = 5.333333      sequence: (4 / 1 + 12 / 2) / 2 kept responses = 5.0
    The same when rank 0 holds responses 0 and 1 and rank 1 holds response 2 (shares times world = 2, averaged).
    All truncated: the counts are 0, the weights 0 and finite (the counts are clamped to 1), the loss 0."""
    loss = torch.tensor([4.0, 1.0, 2.0, 3.0, 5.0, 7.0])
    row = torch.tensor([0, 1, 1, 1, 2, 2])
    lengths, keep = torch.tensor([1, 3, 2]), torch.tensor([True, False, True])
    tokens, seqs = float(lengths[keep].sum()), float(keep.sum())
    for kind, want in (("token", 16 / 3), ("sequence", 5.0)):
        w = loss_weights(kind, lengths[row], max(tokens, 1), max(seqs, 1), 4) * keep[row]
        assert float((loss * w).sum()) == pytest.approx(want)
        shares = [float((loss[r] * w[r]).sum()) * 2 for r in (row < 2, row == 2)]
        assert sum(shares) / 2 == pytest.approx(want)
    none = torch.zeros(3, dtype=torch.bool)
    w = loss_weights("token", lengths[row], max(0.0, 1), max(0.0, 1), 4) * none[row]
    assert torch.isfinite(w).all() and float((loss * w).sum()) == 0.0


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
