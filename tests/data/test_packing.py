"""Packed == padded: per-token log-probs, the DPO loss and its gradients (fp32, atol 1e-5), plus the layout helpers."""

import pytest
import torch
from helpers import prompt_groups

from verl_kit.algos import dpo_loss
from verl_kit.data import (
    layout,
    pack_balanced,
    pack_rows,
    split_by_tokens,
)
from verl_kit.models import load_causal_lm
from verl_kit.train import sequence_logprobs, token_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    torch.manual_seed(0)
    m = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    # Perturb away from init so logits are not nearly uniform.
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _pairs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(n):
        prompt = torch.randint(5, 600, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(2):  # chosen, rejected
            comp = torch.randint(5, 600, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
            seqs.append(prompt + comp)
            masks.append([False] * len(prompt) + [True] * len(comp))
    return seqs, masks


def test_packed_token_logprobs_equal_padded(model):
    seqs, masks = _pairs()
    padded = layout(seqs, masks, pad_id=0, packing=False)
    packed = layout(seqs, masks, pad_id=0, packing=True, packing_length=40)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # really packed: fewer rows
    assert packed.num_tokens == padded.num_tokens == sum(map(len, seqs))
    lp_pad, idx_pad = token_logprobs(model, padded)
    lp_pack, idx_pack = token_logprobs(model, packed)
    # Same multiset of (sequence, token) scores: compare per sequence in order.
    for s in range(len(seqs)):
        a, b = lp_pad[idx_pad == s], lp_pack[idx_pack == s]
        assert a.shape == b.shape == (sum(masks[s]),)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_packed_dpo_loss_and_grads_equal_padded(model):
    seqs, masks = _pairs(seed=1)
    ref = torch.randn(len(seqs) // 2, 2) - 30

    def loss_and_grads(packing):
        model.zero_grad()
        batch = layout(seqs, masks, pad_id=0, packing=packing, packing_length=48)
        logps = sequence_logprobs(model, batch).view(-1, 2)
        loss = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_pad, g_pad = loss_and_grads(False)
    loss_pack, g_pack = loss_and_grads(True)
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=0)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_segments_of_packed_rows():
    """Sequences of 3, 2 and 4 tokens in rows of 5: rows [4 | pad] and [3 | 2], tokens numbered row-major 0-9. Each
    sequence attends over its own tokens, [0 1 2 3], [5 6 7], [8 9]; lists of 4 and 3 go in one batch (3 >= 0.75 x 4),
    the shorter padded with its last token, the 2 in another: slots [0 1 2 3 | 5 6 7 7] [8 9]. Each token's output
    is at its home slot; the padding token 4 reads the zero row after the 10 slots, and slot 7 (a repeat for padding)
    is no token's home (owner 10, the zero row after the tokens, as for the zero row itself). Without the block mask
    there are no segments (flash-attention's varlen path reads the position ids)."""
    seqs = [[7] * 3, [7] * 2, [7] * 4]
    batch = layout(seqs, [[True] * len(s) for s in seqs], pad_id=0, packing=True, packing_length=5)
    assert batch.seq_ids.tolist() == [[2, 2, 2, 2, -1], [0, 0, 0, 1, 1]]
    assert batch.attention_mask is None and batch.inputs()["segments"] is batch.segments
    seg = batch.segments
    assert seg.shapes == [(2, 4), (1, 2)] and seg.slots.tolist() == [0, 1, 2, 3, 5, 6, 7, 7, 8, 9]
    assert seg.home.tolist() == [0, 1, 2, 3, 10, 4, 5, 6, 8, 9]
    assert seg.owner.tolist() == [0, 1, 2, 3, 5, 6, 7, 10, 8, 9, 10] and seg.repeat_slot.numel() == 0
    plain = layout(seqs, [[True] * len(s) for s in seqs], 0, True, 5, block_mask=False)
    assert plain.segments is None and plain.attention_mask is None and "segments" not in plain.inputs()
    padded = layout(seqs, [[True] * len(s) for s in seqs], 0, False)
    assert padded.segments is None and padded.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_pack_rows_fits_and_covers():
    lengths = [5, 9, 3, 7, 2, 10]
    rows = pack_rows(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == 4  # 36 tokens need at least 4 rows of 10
    with pytest.raises(ValueError, match="packing_length"):
        pack_rows([11], 10)


def test_balanced_rows_keep_count_cover_and_narrow():
    """[6, 5, 4, 3, 2] (20 tokens) into rows of 16: best-fit gives [6 5 4] [3 2], padded to 15 wide (10 pad slots).
    Balanced: 2 rows need >= 10 tokens each; rows of 10 give [6 4] [5 3 2], 2 rows, 10 wide, no padding."""
    lengths = [6, 5, 4, 3, 2]
    unbalanced = pack_rows(lengths, 16)
    assert [sorted(lengths[i] for i in r) for r in unbalanced] == [[4, 5, 6], [2, 3]]
    rows = pack_balanced(lengths, 16)
    assert [sorted(lengths[i] for i in r) for r in rows] == [[4, 6], [2, 3, 5]]
    seqs = [[7] * n for n in lengths]
    batch = layout(seqs, [[True] * n for n in lengths], pad_id=0, packing=True, packing_length=16)
    assert batch.input_ids.shape == (len(unbalanced), 10)  # same row count, width 10 <= 15
    assert batch.num_tokens == 20 and [int((batch.seq_ids == i).sum()) for i in range(5)] == lengths  # each once
    # Random lengths: same row count, every sequence once, never wider than plain best-fit.
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(1, 200, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        plain, rows = pack_rows(lengths, 256), pack_balanced(lengths, 256)
        assert len(rows) == len(plain) and sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in r) for r in rows) <= max(sum(lengths[i] for i in r) for r in plain)


def test_split_by_tokens_budget_and_fixed_count():
    costs = [50, 10, 30, 30, 20, 60]
    chunks = split_by_tokens(costs, budget=60)
    assert sorted(i for c in chunks for i in c) == list(range(6))
    assert all(sum(costs[i] for i in c) <= 60 for c in chunks)
    assert len(chunks) == 4  # 200 tokens, budget 60
    fixed = split_by_tokens(costs, None, n_chunks=5)
    assert len(fixed) == 5 and sorted(i for c in fixed for i in c) == list(range(6))


def test_layout_pads_when_packing_does_not_pay():
    """Under the block mask a layout of R rows W wide whose sequences attend over s tokens each costs
    R W + sum(s^2) / 6h (packing.layout_cost); a padded row attends over its whole width. Three sequences of 100,
    h=128, packing_length 200: best-fit needs 2 rows, one half empty, and balancing cannot narrow them (3 of 100 do
    not fit 2 rows under 200); padded 3 * 100 + 3 * 100^2 / 768 = 339 < packed 2 * 200 + 39 = 439, so they are padded.
    One sequence of 400 and 15 of 10 (550 tokens, 2 rows), h=512: balanced rows of 400 ([400] and the 15 tens);
    padded 16 * 400 + 16 * 400^2 / 3072 = 7233 > packed 2 * 400 + (400^2 + 15 * 10^2) / 3072 = 853, so they are
    packed. Without hidden_size, or without the block mask (flash-attention varlen), packing is always kept."""
    even = [[7] * 100] * 3
    batch = layout(even, [[True] * 100] * 3, pad_id=0, packing=True, packing_length=200, hidden_size=128)
    assert batch.input_ids.shape == (3, 100) and batch.attention_mask.dim() == 2 and batch.segments is None
    for kwargs in ({}, {"block_mask": False}):
        assert layout(even, [[True] * 100] * 3, 0, True, 200, hidden_size=None if not kwargs else 128,
                      **kwargs).input_ids.shape == (2, 200)
    skewed = [[7] * 400] + [[7] * 10] * 15
    batch = layout(skewed, [[True] * len(s) for s in skewed], 0, True, 512, hidden_size=512)
    assert batch.input_ids.shape == (2, 400) and batch.attention_mask is None and batch.segments is not None


def _groups():
    """Prompts of 17, 14 and 12 tokens with 4, 3 and 1 completions: sequences sharing their prompts."""
    return prompt_groups(((17, (9, 7, 5, 3)), (14, (8, 6, 4)), (12, (5,))))


def test_shared_prefix_equals_padded(model):
    """A group's prompt laid out once, its completions attending to it (layout's shared_prefix): the same per-token
    log-probs and the same gradients as one padded row per sequence, with fewer tokens through the model. A
    sequence past the shared 16 or 13 tokens is its completion plus the prompt's last token. Rows of 96: one unit
    per group (prefix once: 16 + 13 tokens); rows of 36: the first group's 16 + (10 + 8) and 16 + (6 + 4), so its
    prompt twice (45 prefix tokens). The lone sequence is laid out whole."""
    seqs, masks, shared = _groups()
    padded = layout(seqs, masks, pad_id=0, packing=False)
    for row_len, prefix_tokens in ((96, 29), (36, 45)):
        batch = layout(seqs, masks, pad_id=0, packing=True, packing_length=row_len, shared_prefix=shared)
        assert int((batch.seq_ids >= len(seqs)).sum()) == prefix_tokens  # tokens of the shared prefix segments
        assert batch.num_tokens == sum(map(len, seqs)) - sum(shared[:7]) + prefix_tokens
        for b in (padded, batch):
            model.zero_grad()
            lp, idx = token_logprobs(model, b)
            lp.sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if b is padded:
                lp_pad, idx_pad, g_pad = lp.detach(), idx, grads
                continue
            for s in range(len(seqs)):
                torch.testing.assert_close(lp.detach()[idx == s], lp_pad[idx_pad == s], atol=1e-5, rtol=0)
            for name in g_pad:
                torch.testing.assert_close(grads[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_segments_and_choice():
    """Sequences 0 and 1 share the prefix [3, 4]: the row is [3 4 | 5 6 | 5 7]; 0's tokens attend over the prefix and
    themselves, [0 1 2 3], and own all four (prefix and 0 are contiguous, one causal sequence); 1's attend over the
    prefix and themselves, [0 1 4 5] (slots 4-7), and own the last two; slots 4 and 5 repeat the prefix, whose
    gradients add to its home's. Positions continue after the prefix. A prefix is never shared past the token before
    the first scored one, and the shared layout is used only when it costs less (layout_cost)."""
    seqs, masks = [[3, 4, 5, 6], [3, 4, 5, 7]], [[False, False, False, True]] * 2
    batch = layout(seqs, masks, 0, True, 16, shared_prefix=[2, 2])
    assert batch.input_ids.tolist() == [[3, 4, 5, 6, 5, 7]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    seg = batch.segments
    assert seg.shapes == [(2, 4)] and seg.slots.tolist() == [0, 1, 2, 3, 0, 1, 4, 5]
    assert seg.home.tolist() == [0, 1, 2, 3, 6, 7] and seg.owner.tolist() == [0, 1, 2, 3, 6, 6, 4, 5, 6]
    assert seg.repeat_slot.tolist() == [4, 5] and seg.repeat_token.tolist() == [0, 1]  # the prefix, seen by 1
    assert batch.input_ids[:, 1:][batch.scored].tolist() == [6, 7]
    # asked to share 3 tokens, it shares 2: token 5 predicts the scored 6/7, so each sequence keeps its own
    assert layout(seqs, masks, 0, True, 16, shared_prefix=[3, 3]).input_ids.tolist() == [[3, 4, 5, 6, 5, 7]]
    # two sequences of 5 sharing 2 tokens, rows of 8: shared [3 4 | 9 5 5 | 9 6 6] fills one row where the plain
    # layout takes two of 5; with two sequences of 3 besides, shared [3 4 9 5 5 9 6 6] [7 7 7 8 8 8] takes 2 rows of
    # 8 as the plain [5 + 3] [5 + 3] does: no cheaper, so not shared
    seqs, masks = [[3, 4, 9, 5, 5], [3, 4, 9, 6, 6]], [[False] * 3 + [True] * 2] * 2
    assert layout(seqs, masks, 0, True, 8, shared_prefix=[2, 2]).input_ids.tolist() == [[3, 4, 9, 5, 5, 9, 6, 6]]
    seqs, masks = seqs + [[7] * 3, [8] * 3], masks + [[True] * 3] * 2
    plain = layout(seqs, masks, 0, True, 8, shared_prefix=[2, 2, 0, 0])
    assert plain.input_ids.shape == (2, 8) and int((plain.seq_ids >= 4).sum()) == 0  # no prefix segment
