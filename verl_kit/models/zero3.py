"""ZeRO-3 context managers, no-ops without ZeRO-3: build a model outside the partitioning, gather partitioned
parameters for a block (the one home of both, used by model loading, LoRA export and the weight sync)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def outside_zero3():
    """Build a model on one process of a ZeRO-3 run: transformers would partition it at construction (zero.Init, a
    collective that the other processes never join). A no-op outside ZeRO-3."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


@contextlib.contextmanager
def gathered_params(model, params=None, modifier_rank=None):
    """Gather ZeRO-3 partitioned parameters for the duration of the block; a no-op without ZeRO-3."""
    params = list(model.parameters()) if params is None else list(params)
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield
    else:
        yield
