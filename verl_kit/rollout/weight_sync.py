"""Weight sync, the trainer's side: the policy (ZeRO-3 shards) -> a vLLM engine, after every update.

Every process gathers the parameters in buckets of at most `bucket_mb` MiB (`deepspeed.zero.GatheredParameters` per
bucket, never the whole model at once); the process that pushes encodes each gathered bucket for where it travels
(rollout.transport: same-host slots in /dev/shm, or inline base64) and hands it to the engine's workers through
vLLM's public RPC surface, then commits it there (rollout.worker_extension, the code the workers load). The backends
(rollout.synced.SyncedBackend) then reset the engine's prefix cache (KV of the old policy must not be reused) and
check the sync with a probe (rollout.probe).

A tied parameter (`tie_word_embeddings`: the output layer is the input embedding) is sent once but with every name it
has in the module tree (`named_tensors`), so the engine reloads the tied output layer like an untied one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from verl_kit.models import lora
from verl_kit.rollout.transport import SharedBuckets, encode

_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")  # DDP/DeepSpeed wrapper, torch.compile, PEFT


def engine_name(hf_name: str) -> str:
    """HF parameter name -> the checkpoint name vLLM's `load_weights` expects (it fuses q/k/v, gate/up itself)."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if hf_name.startswith(prefix):
                hf_name, changed = hf_name[len(prefix):], True
    return hf_name


def named_tensors(model) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Each parameter of the policy once, with every name it has in the module tree: a tied output layer is the input
    embedding under a second name (`lm_head.weight` = `model.embed_tokens.weight`), which `named_parameters()` leaves
    out. Of a LoRA policy, the base weights under their plain names; the adapter is merged in by `gathered_buckets`."""
    by_id: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not lora.is_adapter_param(name):
            by_id.setdefault(id(p), ([], p))[0].append(lora.base_name(name))
    return list(by_id.values())


def buckets(model, bucket_bytes: int, sharding=None) -> list[list[tuple[list[str], torch.nn.Parameter]]]:
    """Parameters (with all their names) in order, grouped so a bucket's full (gathered) size stays under
    bucket_bytes; a parameter larger than the budget is a bucket of its own. `sharding` (train.Sharding) counts a
    sharded parameter's full size; None: the parameters are whole."""
    out, cur, size = [], [], 0
    for names, p in named_tensors(model):
        n = (sharding.full_numel(p) if sharding is not None else p.numel()) * p.element_size()
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((names, p))
        size += n
    return out + [cur] if cur else out


def gathered_buckets(model, bucket_bytes: int, sharding=None
                     ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Yield each bucket of `model` (placed by the run's train.Sharding `sharding`, which gathers its full tensors;
    None: a model whose parameters are whole) as ({engine name: full tensor}, {alias: engine name}); a tied tensor is
    sent once, its other names ride along as aliases; a LoRA layer's weight is sent merged (W + scale * B @ A, gathered
    with its A and B). The tensors are the parameters themselves, on their device (under ZeRO-3 the gathered ones; under
    FSDP2 full tensors all-gathered from the DTensor shards, the merge computed on the shards): valid until the next
    bucket is asked for, so the consumer copies them where they go (no copy in between). Collective under ZeRO-3 and
    FSDP2: every process iterates it to the end, in order."""
    full_params = sharding.full_params if sharding is not None else _whole_params
    adapted = lora.lora_layers(model)
    for bucket in buckets(model, bucket_bytes, sharding):
        extra = [q for _, p in bucket if id(p) in adapted for q in lora.adapter_params(adapted[id(p)])]
        with full_params(model, [p for _, p in bucket] + extra) as full:
            tensors = {engine_name(names[0]): full(
                lora.merged_weight(adapted[id(p)], p.data) if id(p) in adapted else p.data).detach()
                for names, p in bucket}
            aliases = {engine_name(a): engine_name(names[0]) for names, _ in bucket for a in names[1:]}
            yield tensors, aliases


@contextlib.contextmanager
def _whole_params(model, params):
    yield lambda t: t


def sync_weights(model, push: Callable[[list[str], float], None] | None, commit: Callable[[float], None] | None,
                 bucket_mb: float, timeout_s: float, shared: SharedBuckets | None = None, sharding=None) -> dict:
    """Gather `model` bucket by bucket, hand the encoded buckets to `push(blobs, seconds_left)`, then call
    `commit(seconds_left)`. Same host (`shared` given: the backend chose same-host slots): each
    bucket is written into its slot as it is gathered and every slot's reference goes in one call after the last;
    otherwise each bucket goes inline, in a call of its own, as it is gathered. A /dev/shm with no room for a slot
    (ENOSPC): that bucket and every later one, in this sync and the next, go inline, with one warning, and the slots
    are removed after the commit. Processes that do not push (ranks without an engine) pass None but still take part
    in the gathers. Raises TimeoutError once `timeout_s` is spent. Returns weight_sync/* metrics."""
    same_host = shared is not None and not shared.full
    t0 = time.time()
    deadline = t0 + timeout_s
    n_bytes = n_buckets = 0

    def left(what: str) -> float:
        remaining = deadline - time.time()
        if remaining <= 0:
            raise TimeoutError(f"weight sync: {what} after {timeout_s:.0f}s (--vllm_sync_timeout_s); "
                               "the engine is slow or gone")
        return remaining

    slots = []
    for tensors, aliases in gathered_buckets(model, int(bucket_mb * 2**20), sharding):
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if push is not None and same_host:  # written now (the gathered bucket can go), sent in one call below
            ref = shared.encode(n_buckets - 1, tensors, aliases)
            if ref is not None:
                slots.append(ref)
                continue
            same_host = False  # /dev/shm is full: this bucket and the rest inline
        if push is not None:
            push([encode(tensors, aliases)], left(f"bucket {n_buckets} not sent"))
    if slots:
        push(slots, left("buckets not sent"))
    if commit is not None:
        commit(left("commit not started"))
    if shared is not None and shared.full:
        shared.close()  # the worker read them in the commit; later syncs go inline
    seconds = time.time() - t0
    return {"weight_sync/seconds": seconds, "weight_sync/bytes": n_bytes, "weight_sync/buckets": n_buckets,
            "weight_sync/bytes_per_s": n_bytes / max(seconds, 1e-9)}


def write_adapter(model, path: str, sharding=None) -> int:
    """The LoRA adapter of `model` (a PeftModel, placed by `sharding`) as peft writes it, adapter_config.json and
    adapter_model.safetensors, into the new folder `path`: what a vLLM engine with LoRA loads (the adapter-only
    sync). Its tensors are gathered whole through `sharding` (collective under ZeRO-3 and FSDP2: every process calls
    it). Returns the adapter's bytes."""
    peft = lora.peft_model(model)
    named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    full_params = sharding.full_params if sharding is not None else _whole_params
    with full_params(model, [p for _, p in named]) as full:
        state = {n: full(p.data).detach().cpu().clone() for n, p in named}
    peft.save_pretrained(path, state_dict=state)
    return sum(t.numel() * t.element_size() for t in state.values())
