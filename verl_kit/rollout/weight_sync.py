"""Weight sync: the trainer's policy (ZeRO-3 shards) -> a vLLM engine, after every update; then a logprob probe.

Every process gathers the parameters in buckets of at most `bucket_mb` MiB (`deepspeed.zero.GatheredParameters` per
bucket, never the whole model at once); the pushing process copies each gathered bucket, in safetensors layout, to
where it travels and hands it to the engine's workers through vLLM's public RPC surface (`LLM.collective_rpc` in
process, `POST /collective_rpc` of a server started with VLLM_SERVER_DEV_MODE=1), into the `WorkerExtension` below.
How a bucket travels: to a worker on this host (a colocated engine, a server on a loopback URL) it is copied
straight from the parameter into its slot, a 0600 file with an unguessable name in this user's private
/dev/shm/verl_kit-<uid> that the trainer and the worker both keep mapped from one sync to the next
(`SharedBuckets`); only the slots' paths and fresh tokens cross the RPC, in one call per sync (the worker refuses
any other path). To another host, or with --vllm_weight_sync_transport inline, each bucket goes base64 in the RPC
body (80 MB: ~0.1 s against ~1 s on CPU, bench/README.md). The extension (`--worker-extension-cls
verl_kit.rollout.weight_sync.WorkerExtension`) stages the buckets and commits them with the worker's
`reload_weights`, which runs the model's own `load_weights` (HF checkpoint names, q/k/v and gate/up fusion) and then
the platform's post-load processing, layer by layer. That last step is why this route works on CPU, where vLLM
repacks linear weights at load time (a oneDNN-packed copy that the matmul reads instead of `weight`) and a plain
in-place `load_weights` has no weight loader to call. The prefix cache is reset after each commit (cached KV of the
old policy must not be reused).

Tied parameters (`tie_word_embeddings`: the output layer is the input embedding). vLLM ties the two modules to one
tensor, and on CPU the output layer `lm_head` computes the logits from its own packed copy of it, made when it is
post-processed. The layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py) post-processes a module
only when its own weights arrive; HF's `named_parameters()` names a tied tensor once (`model.embed_tokens.weight`),
so `lm_head` used to get no weight, no processing ("ParallelLMHead: Failed to load weights" in the engine log), and
kept logits from the first load's weights: the new embeddings with the old output layer, a probe diff that grows
with every update. Two things make a tied engine exact:
- the trainer sends each tensor once but with every name it has in the module tree (`named_tensors`; the other
  names travel as aliases in the bucket's safetensors header), and the extension feeds the model's `load_weights`
  every name, so `lm_head` is reloaded and post-processed like an untied one;
- after the reload the extension re-runs vLLM's post-load step on every module that shares a parameter with
  another (`_verl_kit_reprocess_shared`), as vLLM's first load does, so a tied module is right even where a model's
  loader drops the alias name.
Untied models are unchanged (no aliases, no shared modules).

A GPU fast path (NCCL / CUDA IPC through vLLM's weight-transfer API, no serialisation) can come back with a GPU test.

The check after each sync lives with the backends (verl_kit.rollout.probe.Probe): engine and trainer score a few fixed
sequences (prompt log-probs), with `trainer_logprobs` and `max_abs_diff`, logged as
`rollout/logprob_max_abs_diff`. An fp32 engine matches an fp32 trainer to ~1e-6 (tiny model, tied or not, on CPU);
a stale tied output layer was 0.4 to 2 nats off after one large update.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from verl_kit.models import lora
from verl_kit.models.zero3 import gathered_params

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "verl_kit.rollout.weight_sync.WorkerExtension"
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


def _nbytes(p: torch.Tensor) -> int:
    return (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * p.element_size()


def named_tensors(model) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Each parameter of the policy once, with every name it has in the module tree: a tied output layer is the input
    embedding under a second name (`lm_head.weight` = `model.embed_tokens.weight`), which `named_parameters()` leaves
    out. Of a LoRA policy, the base weights under their plain names; the adapter is merged in by `gathered_buckets`."""
    by_id: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not lora.is_adapter_param(name):
            by_id.setdefault(id(p), ([], p))[0].append(lora.base_name(name))
    return list(by_id.values())


def buckets(model, bucket_bytes: int) -> list[list[tuple[list[str], torch.nn.Parameter]]]:
    """Parameters (with all their names) in order, grouped so a bucket's full (gathered) size stays under
    bucket_bytes; a parameter larger than the budget is a bucket of its own."""
    out, cur, size = [], [], 0
    for names, p in named_tensors(model):
        n = _nbytes(p)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((names, p))
        size += n
    return out + [cur] if cur else out


def gathered_buckets(model, bucket_bytes: int) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Yield each bucket as ({engine name: full tensor}, {alias: engine name}); a tied tensor is sent once, its other
    names ride along as aliases; a LoRA layer's weight is sent merged (W + scale * B @ A, gathered with its A and B).
    The tensors are the parameters themselves, on their device (under ZeRO-3 the gathered ones): valid until the
    next bucket is asked for, so the consumer copies them where they go (no copy in between). Collective under
    ZeRO-3: every process iterates it to the end, in order."""
    adapted = lora.lora_layers(model)
    for bucket in buckets(model, bucket_bytes):
        extra = [q for _, p in bucket if id(p) in adapted for q in lora.adapter_params(adapted[id(p)])]
        with gathered_params(model, [p for _, p in bucket] + extra):
            tensors = {engine_name(names[0]): (lora.merged_weight(adapted[id(p)], p.data) if id(p) in adapted
                                               else p.data).detach() for names, p in bucket}
            aliases = {engine_name(a): engine_name(names[0]) for names, _ in bucket for a in names[1:]}
            yield tensors, aliases


_ALIASES = "verl_kit.aliases"  # safetensors header metadata: {alias: name of the tensor sent}
_TOKEN = "verl_kit.token"  # safetensors header metadata of a same-host bucket: the token its reference carries
SHM_PREFIX = "shm:"  # a same-host bucket travels as "shm:" + json [path, token] (base64 has no ':')
_SHM_ROOT = "/dev/shm"
_SHM_NAME = re.compile(r"(\d+)-[0-9a-f]{32}\.safetensors")  # <pid of the writer>-<random>
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def slot_dir() -> str:
    """Where this user's same-host buckets live, /dev/shm/verl_kit-<uid> (a path only: see shm_dir)."""
    return os.path.join(_SHM_ROOT, f"verl_kit-{os.getuid()}")


def shm_dir() -> str:
    """The kit's own folder for same-host buckets (slot_dir), made 0700 on first use. Refused unless it is a real
    folder (not a link) owned by this user that nobody else can enter; the worker reads only from it."""
    path = slot_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"weight sync: {path} is not a private folder of this user (mode {oct(st.st_mode)}, "
                           f"owner uid {st.st_uid}); remove it, or use --vllm_weight_sync_transport inline")
    _sweep_once(path)
    return path


@functools.cache
def _sweep_once(folder: str) -> None:
    sweep_orphans(folder)


def sweep_orphans(folder: str) -> list[str]:
    """Delete the slot files of writers that are gone (a trainer SIGKILLed, or one that never closed its backend,
    leaves its slots behind, in memory until reboot). Returns the removed paths."""
    removed = []
    for name in os.listdir(folder):
        m = _SHM_NAME.fullmatch(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
        except PermissionError:  # alive, another user's pid: not ours to judge
            pass
    return removed


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[tuple[str, int]], int]:
    """(8-byte length + JSON header, [(name, data offset)], total bytes) of `tensors` in safetensors layout. Widest
    dtype first, so each tensor's offset is a multiple of its element size and the reader can view it in place."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    header, offsets, offset = {"__metadata__": metadata}, [], 0
    for k in order:
        t = tensors[k]
        if t.dtype not in _DTYPES:
            raise TypeError(f"weight sync: {k} has dtype {t.dtype}, which a safetensors bucket cannot carry")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offsets.append((k, offset))
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    head = len(head).to_bytes(8, "little") + head
    return head, offsets, len(head) + offset


def _view_safetensors(buf) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors viewing a writable buffer in safetensors layout (no copy; bytes past the last tensor are ignored), and
    the header's metadata."""
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(bytes(buf[8:8 + n]))
    metadata = header.pop("__metadata__", {})
    if not header:
        return {}, metadata
    data = torch.frombuffer(buf, dtype=torch.uint8, offset=8 + n)
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]].view(_TORCH_DTYPES[v["dtype"]]).view(v["shape"])
            for k, v in header.items()}, metadata


def encode(tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str:
    """A bucket inline: base64 safetensors (aliases in the header), which crosses collective_rpc and the server's JSON
    endpoint to any host. About 5x slower than the same-host transport (`SharedBuckets`, bench/README.md)."""
    from safetensors.torch import save

    metadata = {_ALIASES: json.dumps(aliases)} if aliases else None
    tensors = {k: t.to("cpu").contiguous() for k, t in tensors.items()}
    return base64.b64encode(save(tensors, metadata=metadata)).decode("ascii")


class SharedBuckets:
    """The trainer's end of the same-host transport (one per engine backend). Bucket i of every sync is written into
    slot i: a 0600 file with an unguessable name in `shm_dir()`, created at the first sync and kept, mapped, until
    `close()`; only its reference (path and a fresh token, also written into the file's header) crosses the RPC. The
    worker maps each slot once and keeps the mapping (`decode`). Reusing the slots matters on CPU: a fresh tmpfs file
    or mapping pays a page fault and a zeroed page per 4 KiB on both sides (80 MB: ~30 ms to write a new file here,
    against ~13 ms to copy into pages already there). The cost: the slots hold one copy of the synced weights in
    /dev/shm for the backend's life (also removed when the object is collected or the interpreter exits, as after a
    failed run; a killed trainer's are removed by the next sync's sweep, by pid).

    The worker reads a slot only between the push of its reference and the end of the commit; the trainer writes it
    again only in the next sync, after that commit returned (the sync is synchronous: push, push, ..., commit)."""

    def __init__(self):
        self.slots: list[tuple[str, mmap.mmap]] = []
        self._paths: list[str] = []  # also removed when this object goes or the interpreter exits (a run that failed)
        self.full = False  # a slot did not fit in /dev/shm: this backend sends inline from then on (sync_weights)
        weakref.finalize(self, _unlink_all, self._paths)

    def encode(self, index: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str | None:
        """The bucket written into slot `index`; its reference. None when /dev/shm has no room for the slot: `full`
        is then set (one warning), and the caller sends this bucket and every later one inline."""
        token = secrets.token_hex(16)
        head, offsets, size = _layout(tensors, {**({_ALIASES: json.dumps(aliases)} if aliases else {}), _TOKEN: token})
        try:
            if index >= len(self.slots):
                self.slots.append(self._create(size))
            elif len(self.slots[index][1]) < size:  # the bucket grew: a new, larger slot
                grown = self._create(size)
                self._remove(index)
                self.slots[index] = grown
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self.full = True
            vfs = os.statvfs(shm_dir())
            logger.warning("weight sync: %s is full (%.0f MiB free, a %.0f MiB bucket to place): sending the weights "
                           "inline from now on (~10x slower; a container's /dev/shm is 64 MiB unless started with a "
                           "larger --shm-size)", shm_dir(), vfs.f_bavail * vfs.f_frsize / 2**20, size / 2**20)
            return None
        path, buf = self.slots[index]
        out = torch.frombuffer(buf, dtype=torch.uint8, count=size)
        out[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for k, offset in offsets:  # straight from the (gathered) parameter, on whatever device, into the slot
            t = tensors[k]
            n = t.numel() * t.element_size()
            out[len(head) + offset:len(head) + offset + n].view(t.dtype).view(t.shape).copy_(t)
        del out  # no view may outlive the call: close() unmaps
        return SHM_PREFIX + json.dumps([path, token])

    def _create(self, size: int) -> tuple[str, mmap.mmap]:
        path = os.path.join(shm_dir(), f"{os.getpid()}-{secrets.token_hex(16)}.safetensors")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._paths.append(path)
        try:
            # The pages now: a full tmpfs fails here with ENOSPC, not with a SIGBUS at the first write into the mapping.
            os.posix_fallocate(fd, 0, size)
            return path, mmap.mmap(fd, size)
        except BaseException:
            _unlink_all([path])
            raise
        finally:
            os.close(fd)

    def _remove(self, index: int) -> None:
        path, buf = self.slots[index]
        buf.close()
        _unlink_all([path])
        self._paths.remove(path)

    def close(self) -> None:
        """Remove the slots (the engine's worker may keep its mapping of them until it exits)."""
        for i in range(len(self.slots)):
            self._remove(i)
        self.slots.clear()


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _shm_ref(blob: str) -> tuple[str, str]:
    """(path, token) of a same-host bucket's reference, refused unless the path names a bucket file of the kit's own
    shm folder: the server's RPC endpoint takes its arguments from HTTP clients, so a reference may come from
    anywhere and must never name another file."""
    try:
        path, token = json.loads(blob[len(SHM_PREFIX):])
    except (ValueError, TypeError):
        path = token = None
    folder = shm_dir()
    if not (isinstance(path, str) and isinstance(token, str) and os.path.dirname(path) == folder
            and _SHM_NAME.fullmatch(os.path.basename(path))):
        raise PermissionError(f"weight sync: refused bucket reference {blob[:200]!r}: only files of {folder} are "
                              "read")
    return path, token


_MAPPED: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}  # worker side: slot path -> ((inode, size), mapping)


def decode(blob: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, aliases) of an encoded bucket. A same-host reference: the slot file is opened without following
    links and checked (a regular 0600 file of this user, the reference's token in its header); it is mapped shared
    the first time (and again if it was replaced) and the mapping kept, so the tensors view pages the trainer wrote
    without a copy. `release_mappings` drops the mappings of slots a sync no longer uses."""
    if not blob.startswith(SHM_PREFIX):
        from safetensors.torch import load

        raw = base64.b64decode(blob)
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        return load(raw), json.loads(header.get("__metadata__", {}).get(_ALIASES, "{}"))
    path, token = _shm_ref(blob)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(f"weight sync: bucket file {path} not found: is the engine on another host or in "
                                f"another /dev/shm (a container)? Use --vllm_weight_sync_transport inline") from None
    except OSError as e:  # ELOOP: a link, which O_NOFOLLOW does not follow
        raise PermissionError(f"weight sync: refused {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"weight sync: refused {path}: not a private file of this user")
        key = (st.st_ino, st.st_size)
        if path not in _MAPPED or _MAPPED[path][0] != key:
            _MAPPED[path] = key, mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    tensors, metadata = _view_safetensors(_MAPPED[path][1])
    if not secrets.compare_digest(metadata.get(_TOKEN, ""), token):
        raise PermissionError(f"weight sync: refused {path}: its token does not match the reference")
    return tensors, json.loads(metadata.get(_ALIASES, "{}"))


def release_mappings(keep: set[str]) -> None:
    """Worker side, after a commit: forget the mappings of slots other than `keep` (a closed backend's, a replaced
    slot's); each is unmapped once no tensor views it."""
    for path in [p for p in _MAPPED if p not in keep]:
        del _MAPPED[path]


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods are called by name through collective_rpc.
    Buckets are staged on the worker and committed at once: vLLM's layerwise reload processes a layer when all its
    weights have arrived, and a fused qkv layer may straddle two buckets."""

    def verl_kit_stage(self, *blobs: str) -> int:
        """Stage encoded buckets (all of a same-host sync's slots in one call; an inline bucket per call)."""
        staged = self.__dict__.setdefault("_verl_kit_staged", {})
        refs = self.__dict__.setdefault("_verl_kit_refs", set())  # same-host buckets staged since the last commit
        if not staged:
            refs.clear()
        for blob in blobs:
            if blob in refs:  # a retried request whose first try was staged but not answered
                continue
            tensors, aliases = decode(blob)
            staged.update(tensors)
            self.__dict__.setdefault("_verl_kit_aliases", {}).update(aliases)
            if blob.startswith(SHM_PREFIX):
                refs.add(blob)
        return len(staged)

    def verl_kit_commit(self) -> int:
        staged = self.__dict__.pop("_verl_kit_staged", {})
        aliases = self.__dict__.pop("_verl_kit_aliases", {})
        # Every name of a tied tensor, the aliases last (as in a checkpoint that stores lm_head separately): the
        # model's load_weights then loads the tied output layer like any other layer, see the module docstring.
        weights = list(staged.items()) + [(a, staged[name]) for a, name in aliases.items()]
        n = len(weights)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._verl_kit_reprocess_shared()
        del staged, weights
        release_mappings({_shm_ref(r)[0] for r in self.__dict__.get("_verl_kit_refs", ())})
        return n

    def verl_kit_release(self) -> int:
        """Drop what a trainer staged and every slot mapping (it closed its backend: the slots' memory goes once
        unmapped). Returns the number of mappings dropped."""
        for key in ("_verl_kit_staged", "_verl_kit_aliases", "_verl_kit_refs"):
            self.__dict__.pop(key, None)
        n = len(_MAPPED)
        release_mappings(set())
        return n

    def _verl_kit_reprocess_shared(self) -> None:
        """Re-run vLLM's post-load step (`quant_method.process_weights_after_loading`, what the first load runs on
        every module once all weights are in) on each module that shares a parameter with another module. The
        layerwise reload only post-processes a module whose own weights arrive through the model's `load_weights`;
        a module whose weight is written through its partner (a tied lm_head, when a model's loader drops the
        `lm_head.weight` alias) would keep state derived from the old weight, e.g. the oneDNN-packed copy vLLM on
        CPU computes the logits with. The same inputs as at first load (the shared, already processed tensor),
        so the same result; for unquantized embeddings it rebuilds that packed copy on CPU and is a no-op on GPU.
        Uses the worker's public `get_model()` and `vllm_config` (the context `Worker.reload_weights` sets too):
        vLLM has no call that re-processes a module without reloading it."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        modules = list(self.get_model().modules())
        holders: dict[int, int] = {}
        for m in modules:
            for p in m.parameters(recurse=False):
                holders[id(p)] = holders.get(id(p), 0) + 1
        shared = [m for m in modules if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
                  and any(holders[id(p)] > 1 for p in m.parameters(recurse=False))]
        with set_current_vllm_config(self.vllm_config):
            for m in shared:
                m.quant_method.process_weights_after_loading(m)


def sync_weights(model, push: Callable[[list[str], float], None] | None, commit: Callable[[float], None] | None,
                 bucket_mb: float, timeout_s: float, shared: SharedBuckets | None = None) -> dict:
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
    for tensors, aliases in gathered_buckets(model, int(bucket_mb * 2**20)):
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
