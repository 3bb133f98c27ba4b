"""How a weight-sync bucket travels from the trainer to a vLLM worker: the wire format and the same-host slots.

A bucket is a dict of tensors plus aliases (the other names of a tied tensor, in the header's metadata), laid out as
safetensors. It travels one of two ways (`--vllm_weight_sync_transport`):

- inline (`encode`): base64 of the safetensors bytes in the RPC body, to a worker on any host;
- same host (`SharedBuckets`): the trainer copies each gathered parameter straight into its slot, a 0600 file with an
  unguessable name in this user's private /dev/shm/verl_kit-<uid>, which trainer and worker both keep mapped from
  one sync to the next; only `SHM_PREFIX` + the slot's path and a fresh token cross the RPC. The worker (`decode`)
  reads only files of that folder, checked without following links, whose header carries the reference's token:
  the server's RPC endpoint takes its arguments from HTTP clients.

The measured cost of each is in bench/README.md. The trainer's side of the sync is rollout.weight_sync; the worker's,
rollout.worker_extension. A killed trainer's slots are removed by its orphan guard (verl_kit.launch.processes, given
`slot_dir()` and `SLOT_NAME`) or, failing that, by the next sync's sweep.
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
import weakref

import torch

logger = logging.getLogger(__name__)

_ALIASES = "verl_kit.aliases"  # safetensors header metadata: {alias: name of the tensor sent}
_TOKEN = "verl_kit.token"  # safetensors header metadata of a same-host bucket: the token its reference carries
SHM_PREFIX = "shm:"  # a same-host bucket travels as "shm:" + json [path, token] (base64 has no ':')
_SHM_ROOT = "/dev/shm"
SLOT_NAME = re.compile(r"(\d+)-[0-9a-f]{32}\.safetensors")  # <pid of the writer>-<random>
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
        m = SLOT_NAME.fullmatch(name)
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
    endpoint to any host."""
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


def slot_ref(blob: str) -> tuple[str, str]:
    """(path, token) of a same-host bucket's reference, refused unless the path names a bucket file of the kit's own
    shm folder: the server's RPC endpoint takes its arguments from HTTP clients, so a reference may come from
    anywhere and must never name another file."""
    try:
        path, token = json.loads(blob[len(SHM_PREFIX):])
    except (ValueError, TypeError):
        path = token = None
    folder = shm_dir()
    if not (isinstance(path, str) and isinstance(token, str) and os.path.dirname(path) == folder
            and SLOT_NAME.fullmatch(os.path.basename(path))):
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
    path, token = slot_ref(blob)
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


def release_mappings(keep: set[str]) -> int:
    """Worker side, after a commit: forget the mappings of slots other than `keep` (a closed backend's, a replaced
    slot's); each is unmapped once no tensor views it. Returns the number forgotten."""
    dropped = [p for p in _MAPPED if p not in keep]
    for path in dropped:
        del _MAPPED[path]
    return len(dropped)


