"""The kit's attention for packed rows (models.packed_attention): packed rows, plain and with a shared prefix, give
the logits and gradients of padded rows, with and without gradient checkpointing and with grouped-query attention;
no (L x L) tensor is made at 8192 tokens; without segments the model is transformers' "sdpa"."""

import pytest
import torch
from helpers import prompt_groups
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from verl_kit.data import layout
from verl_kit.models import load_causal_lm, uses_block_mask
from verl_kit.models.packed_attention import SEGMENT_ATTENTION, implementation


def _perturbed(model):
    """Weights moved away from init, so that logits are not nearly uniform."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return _perturbed(load_causal_lm(tiny_model_path, attn_implementation="sdpa"))


@pytest.fixture(scope="module")
def gqa_model():
    """A 2-layer Llama with 4 query heads sharing 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    return _perturbed(LlamaForCausalLM._from_config(config, attn_implementation=implementation("sdpa")))


def _groups():
    """Three prompts of 17, 14 and 12 tokens with 4, 3 and 1 completions, and two lone sequences of 30 and 9."""
    return prompt_groups(((17, (9, 7, 5, 3)), (14, (8, 6, 4)), (12, (5,)), (2, (28,)), (1, (8,))))


def _compare(model, seqs, masks, shared, row_len):
    """The logits of each sequence's own tokens (not those of a prefix segment: every token found in the padded rows
    by its sequence and position) and the gradients of a fixed random weighting of them, packed == padded."""
    padded = layout(seqs, masks, pad_id=0, packing=False)
    packed = layout(seqs, masks, pad_id=0, packing=True, packing_length=row_len, shared_prefix=shared)
    n = len(seqs)
    assert packed.segments is not None and packed.input_ids.shape[0] < n  # really packed
    assert int((packed.seq_ids >= n).sum()) > 0  # with a shared prefix segment
    own = (packed.seq_ids >= 0) & (packed.seq_ids < n)
    seq, pos = packed.seq_ids[own], packed.position_ids[own]  # padded row = sequence, column = position
    weights = torch.randn(int(own.sum()), model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, batch, pick in (("padded", padded, lambda x: x[seq, pos]), ("packed", packed, lambda x: x[own])):
        model.zero_grad()
        logits = pick(model(**batch.inputs()).logits)
        (logits * weights).sum().backward()
        out[name] = logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.testing.assert_close(out["packed"][0], out["padded"][0], atol=1e-5, rtol=0)
    for k, g in out["padded"][1].items():
        torch.testing.assert_close(out["packed"][1][k], g, atol=1e-4, rtol=1e-4, msg=k)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_equals_padded(model, checkpointing):
    """Every own token's logits and every parameter's gradient, packed (shared prompts laid out once) == padded, in
    rows of 96 (one unit per group) and 40 (the first group split in two, its prompt twice)."""
    assert model.config._attn_implementation == SEGMENT_ATTENTION and uses_block_mask(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        for row_len in (96, 40):
            _compare(model, *_groups(), row_len)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def test_grouped_query_attention(gqa_model):
    """The same with 2 key/value heads for 4 query heads (SDPA's enable_gqa)."""
    _compare(gqa_model, *_groups(), 96)


class _LargestAllocation(TorchDispatchMode):
    """The bytes of the largest storage any operation returns (a view counts its whole storage)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def test_no_quadratic_tensor_at_8192_tokens(model, tiny_model_path):
    """One row of 8192 tokens (16 sequences of 512) through the backbone, forward and backward: the largest tensor
    is the MLP's (8192 x 512 fp32, 16 MB), under L^2 = 64 MB, the size of a bool (L x L) mask (the dense fp32 mask
    that packed rows carried before was 256 MB). The control: transformers' "sdpa" on the same rows (position ids
    alone) builds such a mask."""
    L = 8192
    seqs = [torch.randint(5, 600, (512,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16)]
    batch = layout(seqs, [[True] * 512] * 16, pad_id=0, packing=True, packing_length=L)
    assert batch.input_ids.shape == (1, L)
    model.train()
    with _LargestAllocation() as largest:
        model.model(**batch.inputs()).last_hidden_state.sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    assert largest.nbytes < L * L, largest.nbytes
    stock = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    stock.set_attn_implementation("sdpa")
    with torch.no_grad(), _LargestAllocation() as control:
        stock.model(**layout(seqs, [[True] * 512] * 16, 0, True, L, block_mask=False).inputs())
    assert control.nbytes >= L * L, control.nbytes


def test_without_segments_it_is_sdpa(model, tiny_model_path):
    """Where no segments come with a forward, the kit's model computes what transformers' "sdpa" does with the same
    weights: rows packed by position ids alone (it builds "sdpa"'s block mask then), padded rows, and greedy
    generation from left-padded prompts with a KV cache."""
    import copy

    from verl_kit.models import load_tokenizer

    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    seqs, masks, _ = _groups()
    with torch.no_grad():
        for batch in (layout(seqs, masks, 0, True, 96, block_mask=False), layout(seqs, masks, 0, False)):
            assert batch.segments is None
            torch.testing.assert_close(model(**batch.inputs()).logits, stock(**batch.inputs()).logits,
                                       atol=1e-5, rtol=0)
        tokenizer = load_tokenizer(tiny_model_path)
        tokenizer.padding_side = "left"
        enc = tokenizer(["Hello there", "A much longer prompt than the first one"], return_tensors="pt", padding=True)
        outs = [m.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                for m in (model, stock)]
    assert enc["attention_mask"][0, 0] == 0  # really left-padded
    assert torch.equal(outs[0], outs[1])
