"""How a weight-sync bucket travels from the trainer to a vLLM worker: the wire format and the same-host slots.

A bucket is a dict of tensors plus aliases (the other names of a tied tensor, in the header's metadata), laid out as
safetensors. Only a reference to it crosses vLLM's weight-transfer API (the `update_info` of an update); the bytes
travel one of two ways (`--vllm_weight_sync_transport`):

- same host (`SharedBuckets`): the trainer copies each gathered parameter straight into its slot, a 0600 file with an
  unguessable name in this user's private /dev/shm/verl_kit-<uid>, which trainer and worker both keep mapped from
  one sync to the next; the reference is `SHM_PREFIX` + the slot's path and a fresh token. The worker (`decode`)
  reads only files of that folder, checked without following links, whose header carries the reference's token:
  the server's API takes its arguments from HTTP clients.
- streamed (`StreamedBuckets`), to a worker on any host: the trainer serves the bucket's raw bytes over HTTP, from
  one buffer, on an ephemeral port of the address that faces the engine's host; the reference is `PULL_PREFIX` + the
  URL and a fresh token, the only path served; the worker pulls the body straight into its own buffer (`_pull`).
  The token changes with every bucket, so a bucket is served only while its update is in flight. To a server that
  speaks TLS the stream does too: the trainer serves https with a certificate of its own, made for the stream's
  address when the stream opens, and the reference carries that certificate, which the worker pins (it trusts no
  other); the reference itself reaches the worker through the server's TLS API, so the weights never cross the
  network in clear and nobody else can pose as the trainer.

The measured cost of each is in bench/README.md. The trainer's side of the sync is rollout.weight_sync; the worker's,
rollout.worker_extension. A killed trainer's slots are removed by its orphan guard (verl_kit.launch.processes, given
`slot_dir()` and `SLOT_NAME`) or, failing that, by the next sync's sweep.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import torch

logger = logging.getLogger(__name__)

_ALIASES = "verl_kit.aliases"  # safetensors header metadata: {alias: name of the tensor sent}
_TOKEN = "verl_kit.token"  # safetensors header metadata of a same-host bucket: the token its reference carries
SHM_PREFIX = "shm:"  # a same-host bucket's reference: "shm:" + json [path, token]
PULL_PREFIX = "pull:"  # a streamed bucket's reference: "pull:" + json [url, token] (https: [url, token, cert PEM])
PULL_TIMEOUT_S = 60.0  # the worker's socket timeout while it pulls a streamed bucket (connect, each read)
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
                           f"owner uid {st.st_uid}); remove it, or use --vllm_weight_sync_transport stream")
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


def _write(buf, head: bytes, offsets: list[tuple[str, int]], tensors: dict[str, torch.Tensor]) -> None:
    """The bucket laid out by `_layout` into the writable buffer `buf`: each tensor copied straight from the
    (gathered) parameter, on whatever device, into its place. No view of `buf` outlives the call (a slot is unmapped
    by close()). The copies run on one thread: a memory-bound copy gains nothing from more, and on a CPU shared with
    the engine's busy workers torch's thread pool made them 12x slower (SmolLM2, 538 MB: 1.53 s against 0.12 s)."""
    out = torch.frombuffer(buf, dtype=torch.uint8, count=len(head) + sum(
        tensors[k].numel() * tensors[k].element_size() for k in tensors))
    out[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k, offset in offsets:
            t = tensors[k]
            n = t.numel() * t.element_size()
            out[len(head) + offset:len(head) + offset + n].view(t.dtype).view(t.shape).copy_(t)
    finally:
        torch.set_num_threads(threads)
    del out


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
        self.full = False  # a slot did not fit in /dev/shm: this backend streams from then on (sync_weights)
        weakref.finalize(self, _unlink_all, self._paths)

    def encode(self, index: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str | None:
        """The bucket written into slot `index`; its reference. None when /dev/shm has no room for the slot: `full`
        is then set (one warning), and the caller streams this bucket and every later one (StreamedBuckets)."""
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
            logger.warning("weight sync: %s is full (%.0f MiB free, a %.0f MiB bucket to place): streaming the "
                           "weights over loopback from now on (slower; a container's /dev/shm is 64 MiB unless "
                           "started with a larger --shm-size)", shm_dir(), vfs.f_bavail * vfs.f_frsize / 2**20,
                           size / 2**20)
            return None
        path, buf = self.slots[index]
        _write(buf, head, offsets, tensors)
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


def local_address_towards(host: str) -> str:
    """This host's address on the interface that routes to `host` (a UDP socket's connect sends nothing): the address
    an engine on `host` reaches this process at. 127.0.0.1 for a loopback host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


class StreamedBuckets:
    """The trainer's end of the streamed transport (one per engine backend): a small HTTP server on an ephemeral port
    of `address` (the one facing the engines' hosts) that serves the bucket of the update in flight, raw safetensors
    bytes from one buffer reused from bucket to bucket, at the path of a fresh random token; anything else gets 404.
    `encode` replaces the bucket (and the token), so a bucket is readable only until the next one is written: the
    trainer writes the next only after every engine's update call for this one returned. `tls`: https, with a fresh
    self-signed certificate for `address` that each reference carries (see the module docstring). Closed with the
    backend (and when collected)."""

    def __init__(self, address: str = "127.0.0.1", tls: bool = False):
        self._buf = bytearray()
        self._served: tuple[str, int] | None = None  # (token, size) of the bucket in flight
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                served = outer._served
                if served is None or not secrets.compare_digest(self.path, "/" + served[0]):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(served[1]))
                self.end_headers()
                self.wfile.flush()
                self.connection.sendall(memoryview(outer._buf)[:served[1]])

            def log_message(self, *args):  # one request per bucket: no access log
                pass

        self._server = ThreadingHTTPServer((address, 0), Handler)
        self._server.daemon_threads = True
        self.cert_pem = None
        if tls:  # the handshake runs in the request's thread (its first read): a client that stalls holds only that
            context, self.cert_pem = _tls_context(address)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self.url = f"{'https' if tls else 'http'}://{address}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="verl_kit-buckets", daemon=True).start()
        weakref.finalize(self, _stop_server, self._server)

    def encode(self, index: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str:
        """The bucket written into the served buffer; its reference (the URL and the token that is its path)."""
        token = secrets.token_hex(16)
        head, offsets, size = _layout(tensors, {_ALIASES: json.dumps(aliases)} if aliases else {})
        self._served = None
        if len(self._buf) < size:
            self._buf = bytearray(size)
        _write(self._buf, head, offsets, tensors)
        self._served = token, size
        return PULL_PREFIX + json.dumps([self.url, token] + ([self.cert_pem] if self.cert_pem else []))

    def close(self) -> None:
        self._served = None
        _stop_server(self._server)


def _tls_context(address: str):
    """A server-side TLS context with a fresh key and a self-signed certificate for `address`, and the certificate's
    PEM (what the references carry). The key is written only into a private temporary folder, removed at once."""
    import shutil
    import ssl
    import tempfile

    from verl_kit.rollout.vllm_server import self_signed_certificate

    folder = tempfile.mkdtemp(prefix="verl_kit-stream-")
    try:
        cert, key = self_signed_certificate([address], folder, days=7)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        with open(cert) as f:
            return context, f.read()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stop_server(server: ThreadingHTTPServer) -> None:
    if server.socket.fileno() >= 0:
        server.shutdown()
        server.server_close()


def _pull(blob: str):
    """Worker side: the body of a streamed bucket, read straight into a buffer of its size."""
    import http.client

    try:
        url, token, *cert = json.loads(blob[len(PULL_PREFIX):])
        parsed = urlparse(url)
        assert parsed.scheme in ("http", "https") and parsed.hostname and parsed.port and isinstance(token, str)
        assert cert == [] if parsed.scheme == "http" else len(cert) == 1 and isinstance(cert[0], str)
    except (ValueError, TypeError, AssertionError):
        raise PermissionError(f"weight sync: refused bucket reference {blob[:200]!r}") from None
    if cert:  # the trainer's own certificate, pinned: no other is trusted
        import ssl

        context = ssl.create_default_context(cadata=cert[0])
        conn = http.client.HTTPSConnection(parsed.hostname, parsed.port, timeout=PULL_TIMEOUT_S, context=context)
    else:
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=PULL_TIMEOUT_S)
    try:
        conn.request("GET", "/" + token)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"weight sync: {url} answered {r.status} for a bucket (a stale reference?)")
        size = int(r.getheader("Content-Length"))
        buf = torch.empty(size, dtype=torch.uint8).numpy()  # not zero-filled first, as a bytearray would be
        view, got = memoryview(buf), 0
        while got < size:
            n = r.readinto(view[got:])
            if not n:
                raise RuntimeError(f"weight sync: {url} closed after {got} of {size} bytes of a bucket")
            got += n
        return buf
    finally:
        conn.close()


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
    """(tensors, aliases) of a bucket's reference. A streamed one: pulled from the trainer (the tensors view the
    buffer it was read into). A same-host one: the slot file is opened without following
    links and checked (a regular 0600 file of this user, the reference's token in its header); it is mapped shared
    the first time (and again if it was replaced) and the mapping kept, so the tensors view pages the trainer wrote
    without a copy. `release_mappings` drops the mappings of slots a sync no longer uses."""
    if blob.startswith(PULL_PREFIX):
        tensors, metadata = _view_safetensors(_pull(blob))
        return tensors, json.loads(metadata.get(_ALIASES, "{}"))
    path, token = slot_ref(blob)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(f"weight sync: bucket file {path} not found: is the engine on another host or in "
                                f"another /dev/shm (a container)? Use --vllm_weight_sync_transport stream") from None
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


