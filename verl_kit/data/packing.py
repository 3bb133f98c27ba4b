"""Lay variable-length sequences out in rows, packed (padding-free) or padded, and score them exactly.

Packed rows hold several sequences back to back, position ids restarting at 0 for each. Attention is kept inside each
sequence in one of two ways. With `block_mask` (the kit's "sdpa", models.packed_attention) the batch carries the rows'
Segments, which the model's attention reads from the forward's `segments` keyword: memory grows with the sequences,
never as (L x L) per row, and a group's shared prompt can be laid out once. Without it, the position ids alone mark the
sequences: flash-attention's varlen path reads them, and "sdpa"/"eager" models loaded outside the kit's loaders get
transformers' own dense block mask built from them. Either way the forward must run without a KV cache: transformers
infers packed sequences from position ids only when both attention_mask and past_key_values are None, and a forward
with use_cache on (the config default) makes a cache first, so the sequences attend to each other (measured on the
tiny model: 0.85 in the logits against 4e-7 with use_cache=False); TokenBatch.inputs() turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_kit.models.packed_attention import SEGMENTS, Segments


@dataclass
class TokenBatch:
    """N sequences laid out in R rows of length L. Fields:

    input_ids      (R, L) long   token ids, pad_id in padding
    position_ids   (R, L) long   restart at 0 at each sequence start
    seq_ids        (R, L) long   index of the sequence a token belongs to, -1 for padding
    loss_mask      (R, L) bool   token is scored (a completion token)
    attention_mask (R, L) long   padding mask (padded layout), or None (packed)
    segments       Segments      which tokens each sequence attends over (packed with the block mask), or None
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None
    num_seqs: int
    segments: Segments | None = None

    def to(self, device) -> TokenBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenBatch(move(self.input_ids), move(self.position_ids), move(self.seq_ids), move(self.loss_mask),
                          move(self.attention_mask), self.num_seqs, move(self.segments))

    @property
    def scored(self) -> torch.Tensor:
        """(R, L-1) bool: position t predicts a scored token (loss_mask at t+1, same sequence). logits[:, :-1][scored]
        are the logits of the scored tokens input_ids[:, 1:][scored], in row-major order."""
        return self.loss_mask[:, 1:] & (self.seq_ids[:, 1:] == self.seq_ids[:, :-1])

    def inputs(self) -> dict:
        """The keyword arguments of a causal LM's (or its backbone's) forward on this batch: every model call on a
        TokenBatch goes through here. No KV cache (see the module docstring); the segments, when there are any, for
        the kit's attention (models.packed_attention)."""
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids,
                    use_cache=False, **({SEGMENTS: self.segments} if self.segments is not None else {}))

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return int((self.seq_ids >= 0).sum())


def pack_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of sequence indices into rows of at most `row_len` tokens."""
    rows: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > row_len:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit packing_length={row_len}")
        best = min((r for r in range(len(rows)) if space[r] >= lengths[i]), key=lambda r: space[r], default=None)
        if best is None:
            rows.append([i])
            space.append(row_len - lengths[i])
        else:
            rows[best].append(i)
            space[best] -= lengths[i]
    return rows


def pack_balanced(lengths: list[int], row_len: int) -> list[list[int]]:
    """pack_rows, then re-packed into the smallest row length that still gives no more rows (binary search between
    the longest sequence, or the mean row, and the widest row): the rows come out balanced, so padding them to the
    widest wastes less. E.g. [6, 5, 4, 3, 2] into rows of 16: [6 5 4] [3 2], 15 wide; balanced [6 4] [5 3 2], 10."""
    rows = pack_rows(lengths, row_len)
    width = lambda rs: max(sum(lengths[i] for i in r) for r in rs)  # noqa: E731
    lo, hi = max(max(lengths), -(-sum(lengths) // len(rows))), width(rows)
    while lo < hi:  # `rows` fits in rows of `hi` tokens
        mid = (lo + hi) // 2
        tighter = pack_rows(lengths, mid)
        if len(tighter) <= len(rows):
            rows, hi = tighter, width(tighter)
        else:
            lo = mid + 1
    return rows


def layout_cost(rows: int, width: int, spans: list[int], hidden_size: int | None) -> float:
    """Relative compute of `rows` rows of `width` tokens whose attention runs over sequences (spans) of the given
    lengths: linear layers cost ~24 h^2 flops per token slot, padding included, attention ~4 s^2 h per span of s
    tokens, so rows * width + sum(s^2) / (6 h); the slots alone without `hidden_size`. A padded row is one span of its
    full width (its padding masked, not skipped); a packed row's spans are its sequences (Segments)."""
    return rows * width + (sum(s * s for s in spans) / (6.0 * hidden_size) if hidden_size else 0.0)


def layout(seqs: list[list[int]], loss_masks: list[list[bool]], pad_id: int, packing: bool,
           packing_length: int | None = None, block_mask: bool = True, hidden_size: int | None = None,
           shared_prefix: list[int] | None = None) -> TokenBatch:
    """Build a TokenBatch. `packing=False`: one sequence per row, right-padded to the longest.
    `packing=True`: sequences packed into rows of at most `packing_length` tokens (default: the longest sequence),
    balanced (pack_balanced: no more rows than best-fit gives, padded to a width no larger than it must be).
    `block_mask` (models.loading.uses_block_mask): the rows carry their Segments for the kit's attention; without it,
    position ids alone mark the sequences (see the module docstring). With the block mask and the model's
    `hidden_size`, sequences of near-equal length (little padding to save) are padded instead when that costs less
    (layout_cost).

    `shared_prefix[i]` (with packing and the block mask): sequence i may share its first `shared_prefix[i]` tokens
    with the other sequences that start with the same tokens (a GRPO group's prompt). Such a group is laid out as one
    prefix segment followed by each sequence's remaining tokens, which attend to the prefix and to themselves, their
    positions continuing after it: the prefix goes through the model's linear layers once instead of once per
    sequence, with the same result. A group is split into as many such units as a row needs; the shared layout is
    used when it takes fewer token slots than the plain one. Prefix tokens are never scored, so the shared length
    must end before the first scored token's predecessor (a prompt's length minus one)."""
    lengths = [len(s) for s in seqs]
    n = len(seqs)
    units = [(0, [i]) for i in range(n)]  # (shared prefix length, its sequences); 0: one whole sequence
    rows = [[u] for u in range(n)]  # unit indices per row
    width = max(lengths)
    if packing:
        row_len = max(packing_length or 0, max(lengths))
        best = layout_cost(n, width, [width] * n, hidden_size) if block_mask and hidden_size else float("inf")
        plans = [units]
        if shared_prefix and block_mask:  # never share a token that is scored or predicts one
            first = [next((t for t, m in enumerate(mask) if m), len(mask)) for mask in loss_masks]
            plans.append(share_units(seqs, [min(s, f - 1) for s, f in zip(shared_prefix, first)], row_len))
        for plan in plans:  # every sequence still attends over all its tokens: the spans are the same in each plan
            sizes = [p + sum(lengths[i] - p for i in members) for p, members in plan]
            plan_rows = pack_balanced(sizes, row_len)
            plan_width = max(sum(sizes[u] for u in r) for r in plan_rows)
            cost = layout_cost(len(plan_rows), plan_width, lengths, hidden_size)
            if cost < best:
                best, units, rows, width = cost, plan, plan_rows, plan_width
        packing = len(rows) < n or any(p for p, _ in units) or not (block_mask and hidden_size)
    R = len(rows)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, width), dtype=torch.long)
    seq_ids = torch.full((R, width), -1, dtype=torch.long)
    loss_mask = torch.zeros((R, width), dtype=torch.bool)
    spans = []  # per sequence: (row-major indices of the tokens it attends over, first of its own), for Segments
    for r, row in enumerate(rows):
        at = 0
        for u in row:
            p, members = units[u]
            prefix = list(range(r * width + at, r * width + at + p))
            pieces = [(n + u, seqs[members[0]][:p], [False] * p, 0)] if p else []
            pieces += [(i, seqs[i][p:], loss_masks[i][p:], p) for i in members]
            for sid, ids, mask, start in pieces:
                k = len(ids)
                input_ids[r, at:at + k] = torch.tensor(ids)
                position_ids[r, at:at + k] = torch.arange(start, start + k)
                seq_ids[r, at:at + k] = sid
                loss_mask[r, at:at + k] = torch.tensor(mask, dtype=torch.bool)
                if sid < n:  # the first member, right after the prefix, also owns the prefix's tokens
                    own = list(range(r * width + at, r * width + at + k))
                    spans.append((prefix + own, 0 if sid == members[0] else p))
                at += k
    if not packing:
        return TokenBatch(input_ids, position_ids, seq_ids, loss_mask, (seq_ids >= 0).long(), n)
    segments = Segments.build(spans, R * width) if block_mask else None
    return TokenBatch(input_ids, position_ids, seq_ids, loss_mask, None, n, segments)


def share_units(seqs: list[list[int]], shared_prefix: list[int], row_len: int) -> list[tuple[int, list[int]]]:
    """Sequences grouped by their first shared_prefix[i] tokens, as (prefix length, members) units that fit a row
    of `row_len` tokens with the prefix once (longest first, first fit); a unit of one member is a whole sequence
    (prefix length 0)."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(tuple(s[:shared_prefix[i]]) if shared_prefix[i] > 0 else (-1, i), []).append(i)
    units = []
    for members in groups.values():
        p = shared_prefix[members[0]]
        while members:
            take, size = [], p
            for i in sorted(members, key=lambda i: -len(seqs[i])):
                if size + len(seqs[i]) - p <= row_len:
                    take.append(i)
                    size += len(seqs[i]) - p
            members = [i for i in members if i not in take]
            units.append((p, sorted(take)) if len(take) > 1 else (0, take))
    return units


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] in fp32: logits (M, V), targets (M,) -> (M,)."""
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def split_by_tokens(costs: list[int], budget: int | None, n_chunks: int | None = None) -> list[list[int]]:
    """Split item indices into micro-batches. With `n_chunks`, exactly that many (balanced by cost, longest first, so
    every rank can run the same number of forward passes under ZeRO-3); otherwise the fewest chunks whose summed
    cost stays within `budget` (first-fit decreasing; an item larger than the budget gets a chunk of its own)."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    if n_chunks is not None:
        chunks: list[list[int]] = [[] for _ in range(n_chunks)]
        load = [0] * n_chunks
        for i in order:
            j = min(range(n_chunks), key=lambda j: (load[j], len(chunks[j])))
            chunks[j].append(i)
            load[j] += costs[i]
        return [sorted(c) for c in chunks if c]
    chunks, load = [], []
    for i in order:
        j = next((j for j in range(len(chunks)) if load[j] + costs[i] <= budget), None)
        if j is None:
            chunks.append([i])
            load.append(costs[i])
        else:
            chunks[j].append(i)
            load[j] += costs[i]
    return [sorted(c) for c in chunks]
