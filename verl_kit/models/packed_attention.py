"""Attention over packed rows whose memory grows with the sequences, not with the row: "sdpa" plus segments.

A packed row (verl_kit.data.packing.layout) holds several sequences back to back, and a sequence of a shared-prefix
group also attends to its group's prefix segment. The dense way to say so is an (R, 1, L, L) mask: 64 MB of fp32 for
one 4k-token row, 4 GB at 32k. Here the row is described instead by its Segments: each sequence as the list of the
row's token indices it attends over (its prefix, then itself), and attention runs causally on those lists, gathered
into a few right-padded batches of similar length, one SDPA call each (is_causal, no mask: PyTorch's flash kernel on
CPU, memory O(tokens)); every token's output is read back from the list it belongs to. A shared prefix is attended
again by each of its sequences (as the padded layout does) while the layers outside attention see it once.

SEGMENT_ATTENTION is registered with transformers (AttentionInterface, AttentionMaskInterface) under its own name by
`implementation("sdpa")`, which the kit's loaders call: a forward given the `segments` keyword (TokenBatch.inputs())
runs segment_attention; any other forward (HF generate with left padding and a KV cache, a plain call) is exactly
"sdpa". transformers hands the keyword on from the model's forward to each attention call, through gradient
checkpointing's recompute too (GradientCheckpointingLayer keeps the keyword arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SEGMENT_ATTENTION = "verl_kit_segments"  # the attn_implementation name the kit's loaders use in place of "sdpa"
SEGMENTS = "segments"  # the forward keyword that carries a packed batch's Segments

# A sequence joins the current batch of a segment_attention call while its length is at least this fraction of the
# batch's longest: attention over the padding then costs at most 1 / BUCKET_RATIO^2 of the sequence's own, and a
# batch of lengths from 16 to 4096 makes about 20 calls per layer.
BUCKET_RATIO = 0.75


@dataclass
class Segments:
    """The attention pattern of packed rows (R, L), as index lists into their T = R*L tokens (row-major). The lists
    are laid out as batches of shapes (n_b, W_b): each batch row one attended sequence, the tokens it attends over in
    order (a shared prefix, then its own tokens), right-padded by repeating its last token; the S = sum n_b W_b
    places of all batches, flattened and concatenated, are the slots. Fields:

    shapes        [(n_b, W_b)]    the batches, in order
    slots         (S,) long       the token in each slot
    home          (T,) long       the slot of each token's own output; S (a zero row) for a padding token
    owner         (S+1,) long     the token whose home each slot is; T (a zero row) for the others and the zero row
    repeat_slot   (E,) long       the other slots of a real token (its shared prefix in a later sequence's list)...
    repeat_token  (E,) long       ... and that token

    home and owner are each other's inverse: both gathers' backward passes are gathers (_Gather), not scatters.
    """

    shapes: list[tuple[int, int]]
    slots: torch.Tensor
    home: torch.Tensor
    owner: torch.Tensor
    repeat_slot: torch.Tensor
    repeat_token: torch.Tensor

    def to(self, device) -> Segments:
        return Segments(self.shapes, *(t.to(device) for t in (self.slots, self.home, self.owner, self.repeat_slot,
                                                               self.repeat_token)))

    @classmethod
    def build(cls, sequences: list[tuple[list[int], int]], num_tokens: int) -> Segments:
        """`sequences`: (token indices attended over, causally; the first index that is the sequence's own) for each
        attended sequence; every token of the rows (`num_tokens`) that is not padding is its own in exactly one.
        Sequences are batched longest first, each batch down to BUCKET_RATIO of its longest."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        shapes, slots, home, repeats, at = [], [], [-1] * num_tokens, [], 0
        while at < len(order):
            width = len(sequences[order[at]][0])
            end = at
            while end < len(order) and len(sequences[order[end]][0]) >= BUCKET_RATIO * width:
                end += 1
            for i in order[at:end]:
                tokens, own = sequences[i]
                for j, t in enumerate(tokens):
                    if j >= own:
                        home[t] = len(slots) + j
                    else:
                        repeats.append((len(slots) + j, t))
                slots += tokens + tokens[-1:] * (width - len(tokens))
            shapes.append((end - at, width))
            at = end
        S = len(slots)
        home = [S if h < 0 else h for h in home]
        owner = [num_tokens] * (S + 1)
        for t, h in enumerate(home):
            if h < S:
                owner[h] = t
        repeat_slot, repeat_token = zip(*repeats) if repeats else ((), ())
        long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return cls(shapes, long(slots), long(home), long(owner), long(repeat_slot), long(repeat_token))


class _Gather(torch.autograd.Function):
    """y = x[index] over the first dimension, y (N, ...). The backward is a gather too, through `adjoint` (for each
    row of x, the one row of y that holds it, or N for none: a zero row), plus the rows that y holds more than once
    (`repeat_from` rows of y, `repeat_to` rows of x), added: PyTorch's own backward of index_select is a scatter-add
    over every element, on CPU slower than the attention it serves."""

    @staticmethod
    def forward(ctx, x, index, adjoint, repeat_from, repeat_to):
        ctx.save_for_backward(adjoint, repeat_from, repeat_to)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        adjoint, repeat_from, repeat_to = ctx.saved_tensors
        out = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])]).index_select(0, adjoint)
        if repeat_from.numel():
            out.index_add_(0, repeat_to, grad.index_select(0, repeat_from))
        return out, None, None, None, None


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, L, D), key and value (B, H_kv, L, D) -> the output
    (B, L, H, D) and no weights. With `segments` (Segments of the B x L tokens): causal attention within each listed
    sequence, padding tokens' output zero. Without: transformers' sdpa_attention_forward, given the mask "sdpa"
    would have built (see segment_mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments: Segments | None = kwargs.pop(SEGMENTS, None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if segments is None:
        if attention_mask is None and causal:
            attention_mask = _packed_mask(query, key, kwargs.get("position_ids"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None or not causal:
        raise ValueError(f"{SEGMENT_ATTENTION}: packed segments need plain causal attention, but the model asks for "
                         "a mask of its own (sliding window, bidirectional or multimodal layers); use --packing false "
                         "or --attn_implementation eager")
    B, H, L, _ = query.shape
    seg = segments
    sizes = [n * W for n, W in seg.shapes]
    q, k, v = (_Gather.apply(t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[3]), seg.slots, seg.home,
                             seg.repeat_slot, seg.repeat_token).split(sizes) for t in (query, key, value))
    outs, gqa = [], key.shape[1] != H
    for (n, W), *qkv in zip(seg.shapes, q, k, v):
        o = F.scaled_dot_product_attention(*(t.view(n, W, *t.shape[1:]).transpose(1, 2) for t in qkv),
                                           dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(n * W, H, o.shape[-1]))
    outs.append(outs[0].new_zeros(1, H, outs[0].shape[-1]))  # the home of padding tokens
    empty = seg.repeat_slot[:0]
    return _Gather.apply(torch.cat(outs), seg.home, seg.owner, empty, empty).view(B, L, H, -1), None


def _packed_mask(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The block-causal bool mask (B, 1, L, L) that "sdpa" builds for rows packed by restarting position ids alone
    (transformers' find_packed_sequence_indices), which segment_mask leaves to the attention; None for rows that are
    one sequence each or with a KV cache (fewer queries than keys)."""
    from transformers.masking_utils import find_packed_sequence_indices

    L = query.shape[2]
    if position_ids is None or L == 1 or key.shape[2] != L:
        return None
    packed = find_packed_sequence_indices(position_ids.expand(query.shape[0], -1))
    if packed is None:
        return None
    causal = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()
    return ((packed[:, :, None] == packed[:, None, :]) & causal)[:, None]


def segment_mask(**kwargs) -> torch.Tensor | None:
    """The mask function of SEGMENT_ATTENTION: "sdpa"'s (transformers' sdpa_mask), except that a forward without
    padding mask, KV cache, window or extra mask functions gets None. Such a forward is either one causal sequence per
    row, or packed rows, which transformers detects from the position ids and would otherwise mask with a dense
    (R, 1, L, L) tensor: segment_attention handles them from the `segments` keyword (or, given none, from the
    position ids)."""
    from transformers.masking_utils import sdpa_mask

    unpadded = (kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
                and not kwargs.get("use_vmap", False) and kwargs["q_length"] == kwargs["kv_length"]
                and _is_zero(kwargs.get("q_offset", 0)) and _is_zero(kwargs.get("kv_offset", 0)))
    return None if unpadded else sdpa_mask(**kwargs)


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def implementation(name: str) -> str:
    """The attn_implementation to load a model with for the kit's `name`: SEGMENT_ATTENTION (registered with
    transformers on first use) for "sdpa", `name` itself otherwise (flash-attention reads packed sequences from
    position ids; eager gets transformers' dense mask)."""
    if name != "sdpa":
        return name
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, segment_mask)
    return SEGMENT_ATTENTION
