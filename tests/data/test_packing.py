"""Packed == padded: per-token log-probs, the DPO loss and its gradients (fp32, atol 1e-5), plus the layout helpers."""

import pytest
import torch

from verl_kit.algos import dpo_loss
from verl_kit.data import (
    block_causal_mask,
    forward_logits,
    layout,
    pack_balanced,
    pack_rows,
    sequence_logprobs,
    split_by_tokens,
    token_logprobs,
)
from verl_kit.models import load_causal_lm


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
    lp_pad, idx_pad = token_logprobs(forward_logits(model, padded), padded)
    lp_pack, idx_pack = token_logprobs(forward_logits(model, packed), packed)
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
        logps = sequence_logprobs(forward_logits(model, batch), batch).view(-1, 2)
        loss = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_pad, g_pad = loss_and_grads(False)
    loss_pack, g_pack = loss_and_grads(True)
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=0)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_block_causal_mask_shape_and_values():
    """Row [0,0,1,-1]: token 2 (seq 1) sees only itself; token 1 sees 0 and 1; padding sees itself."""
    m = block_causal_mask(torch.tensor([[0, 0, 1, -1]]))
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


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
    """Under the dense block mask a packed row of W tokens costs W (1 + W / 6h) (packing.row_cost). 16 sequences of
    40 tokens, h=512, packing_length 512: best-fit needs 2 rows (12 + 4 sequences), balanced to 8 + 8, 320 wide;
    padded 16 * 40 * 1.013 = 648 < packed 2 rows * 320 * 1.104 = 707, so they are padded. One sequence of 400 and 15
    of 10 (550 tokens, 2 rows): balanced rows of 400 ([400] and the 15 tens, 150); padded 16 * 400 * 1.13 = 7233 >
    packed 2 * 400 * 1.13 = 904, so they are packed. Without hidden_size, or without the block mask
    (flash-attention varlen), packing is always kept."""
    even = [[7] * 40] * 16
    batch = layout(even, [[True] * 40] * 16, pad_id=0, packing=True, packing_length=512, hidden_size=512)
    assert batch.input_ids.shape == (16, 40) and batch.attention_mask.dim() == 2
    for kwargs in ({}, {"block_mask": False}):
        assert layout(even, [[True] * 40] * 16, 0, True, 512, hidden_size=None if not kwargs else 512,
                      **kwargs).input_ids.shape == (2, 320)
    skewed = [[7] * 400] + [[7] * 10] * 15
    batch = layout(skewed, [[True] * len(s) for s in skewed], 0, True, 512, hidden_size=512)
    assert batch.input_ids.shape == (2, 400) and batch.attention_mask.dim() == 4


def _groups():
    """Prompts of 17, 14 and 12 tokens with 4, 3 and 1 completions: sequences sharing their prompts."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, 600, (n,), generator=g).tolist()  # noqa: E731
    seqs, masks, shared = [], [], []
    for n, completions in ((17, (9, 7, 5, 3)), (14, (8, 6, 4)), (12, (5,))):
        prompt = rand(n)
        for k in completions:
            seqs.append(prompt + rand(k))
            masks.append([False] * n + [True] * k)
            shared.append(n - 1)
    return seqs, masks, shared


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
            lp, idx = token_logprobs(forward_logits(model, b), b)
            lp.sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if b is padded:
                lp_pad, idx_pad, g_pad = lp.detach(), idx, grads
                continue
            for s in range(len(seqs)):
                torch.testing.assert_close(lp.detach()[idx == s], lp_pad[idx_pad == s], atol=1e-5, rtol=0)
            for name in g_pad:
                torch.testing.assert_close(grads[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_mask_and_choice():
    """Sequences 0 and 1 share the prefix [3, 4]: the row is [3 4 | 5 6 | 5 7]; 0's tokens see the prefix and
    themselves, never 1's; positions continue after the prefix. A prefix is never shared past the token before the
    first scored one, and the shared layout is used only when it costs less (row_cost)."""
    seqs, masks = [[3, 4, 5, 6], [3, 4, 5, 7]], [[False, False, False, True]] * 2
    batch = layout(seqs, masks, 0, True, 16, shared_prefix=[2, 2])
    assert batch.input_ids.tolist() == [[3, 4, 5, 6, 5, 7]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    allowed = (batch.attention_mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                       [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]]
    assert batch.input_ids[:, 1:][batch.scored].tolist() == [6, 7]
    # asked to share 3 tokens, it shares 2: token 5 predicts the scored 6/7, so each sequence keeps its own
    assert layout(seqs, masks, 0, True, 16, shared_prefix=[3, 3]).input_ids.tolist() == [[3, 4, 5, 6, 5, 7]]
    # completions of 38 tokens after a 2-token prompt, h = 8: sharing saves one token but one row of 79 costs
    # 79 (1 + 79/48) = 209 against two padded rows of 40, 2 * 40 (1 + 40/48) = 147
    long = [[3, 4] + [5] * 38, [3, 4] + [6] * 38]
    plain = layout(long, [[False] * 2 + [True] * 38] * 2, 0, True, 128, hidden_size=8, shared_prefix=[1, 1])
    assert plain.input_ids.tolist() == long and plain.attention_mask.dim() == 2
