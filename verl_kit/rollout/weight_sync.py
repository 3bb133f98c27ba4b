"""Weight sync, the trainer's side: the policy (ZeRO-3 or FSDP2 shards) -> a vLLM engine, after every update, through
vLLM's weight-transfer API.

Every process gathers the parameters in buckets of at most `bucket_mb` MiB (through the run's train.Sharding, never
the whole model at once); the process that pushes writes each gathered bucket where it travels (rollout.transport:
a same-host slot in /dev/shm, or the stream this process serves) and hands its reference to the engine in an
`update_weights` call between `start_weight_update` and `finish_weight_update` (the backend's calls of vLLM's API,
rollout.synced.SyncedBackend; the engine on the workers' side is rollout.worker_extension). The backends then reset
the engine's prefix cache (KV of the old policy must not be reused) and check the sync with a probe
(rollout.probe).

A tied parameter (`tie_word_embeddings`: the output layer is the input embedding) is sent once but with every name it
has in the module tree (`named_tensors`), so the engine reloads the tied output layer like an untied one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from verl_kit.models import lora
from verl_kit.rollout.transport import SharedBuckets, StreamedBuckets

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


def sync_weights(model, engine, bucket_mb: float, timeout_s: float, shared: SharedBuckets | None,
                 stream: Callable[[], StreamedBuckets], sharding=None, version: int = 0) -> dict:
    """Gather `model` bucket by bucket into the engine: `engine.start_weight_update`, `engine.update_weights(refs)`,
    then `engine.finish_weight_update(version)` (rollout.synced.SyncedBackend: vLLM's weight-transfer API). Same host
    (`shared` given: the backend chose same-host slots): each bucket is written into its slot as it is gathered and
    every slot's reference goes in one update after the last; otherwise each bucket is streamed (`stream()`, the
    backend's StreamedBuckets) in an update of its own as it is gathered. A /dev/shm with no room for a slot (ENOSPC):
    that bucket and every later one, in this sync and the next, are streamed, with one warning, and the slots are
    removed after the finish. Processes that do not push (ranks without an engine) pass engine None but still take part
    in the gathers. Raises TimeoutError once `timeout_s` is spent. Returns sync/* metrics (sync/bytes: one engine's)."""
    t0 = time.time()
    deadline = t0 + timeout_s
    n_bytes = n_buckets = 0

    def left(what: str) -> float:
        remaining = deadline - time.time()
        if remaining <= 0:
            raise TimeoutError(f"weight sync: {what} after {timeout_s:.0f}s (--vllm_sync_timeout_s); "
                               "the engine is slow or gone")
        return remaining

    if engine is not None:
        engine.start_weight_update(left("update not started"))
    slots = []
    for tensors, aliases in gathered_buckets(model, int(bucket_mb * 2**20), sharding):
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if engine is None:
            continue
        if shared is not None and not shared.full:  # written now (the gathered bucket can go), sent below
            ref = shared.encode(n_buckets - 1, tensors, aliases)
            if ref is not None:
                slots.append(ref)
                continue
        engine.update_weights([stream().encode(n_buckets - 1, tensors, aliases)], left(f"bucket {n_buckets} not sent"))
    if slots:
        engine.update_weights(slots, left("buckets not sent"))
    if engine is not None:
        engine.finish_weight_update(version, left("update not finished"))
    if shared is not None and shared.full:
        shared.close()  # the workers read them in this update; later syncs stream
    seconds = time.time() - t0
    return {"sync/seconds": seconds, "sync/bytes": n_bytes, "sync/buckets": n_buckets,
            "sync/bytes_per_s": n_bytes / max(seconds, 1e-9), "sync/version": version}


def write_adapter(model, path: str | None, sharding=None) -> int:
    """The LoRA adapter of `model` (a PeftModel, placed by `sharding`) as peft writes it, adapter_config.json and
    adapter_model.safetensors, into the new folder `path` (None: a process that only joins the gather): what a vLLM
    engine with LoRA loads (the adapter-only sync). Its tensors are gathered whole through `sharding` (collective
    under ZeRO-3 and FSDP2: every process calls it). Returns the adapter's bytes."""
    peft = lora.peft_model(model)
    named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    full_params = sharding.full_params if sharding is not None else _whole_params
    with full_params(model, [p for _, p in named]) as full:
        state = {n: full(p.data).detach().cpu().clone() for n, p in named}
    if path is not None:
        peft.save_pretrained(path, state_dict=state)
    return sum(t.numel() * t.element_size() for t in state.values())
