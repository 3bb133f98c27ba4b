"""The vLLM OpenAI server a run (or `make vllm-serve`) starts for weight-synced rollouts: its command, environment and
process lifecycle. The client side is verl_kit.rollout.vllm_client.VLLMServer.

    python -m verl_kit.rollout.vllm_server serve --model tiny-llama --port 8000     # what `make vllm-serve` runs
    VLLM_API_KEY=... python -m verl_kit.rollout.vllm_server serve --model PATH --host 0.0.0.0

The weight sync needs vLLM's dev endpoints (/collective_rpc, /reset_prefix_cache), which can replace the model's
weights, and vLLM's own --api-key guards only /v1/* and a few other prefixes. So the server binds 127.0.0.1 by default,
refuses any other host unless VLLM_API_KEY is set, and with a key set it is started through `api-server` below, which
extends vLLM's authentication middleware to every path (health included); the kit's client sends the key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from verl_kit.errors import UserError
from verl_kit.models.loading import resolve_model_path
from verl_kit.rollout.weight_sync import WORKER_EXTENSION, slot_dir

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback_url(url: str) -> bool:
    """A server URL on this host's loopback (the server then shares this host's /dev/shm: weight buckets go through
    files there, verl_kit.rollout.weight_sync.SharedBuckets)."""
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key() -> str | None:
    """The key a server started by the kit requires and the kit's client sends (VLLM_API_KEY, as vLLM reads it)."""
    return os.environ.get("VLLM_API_KEY") or None


def serve_command(model_path: str, port: int, *, host: str = "127.0.0.1", dtype: str = "auto",
                  max_num_seqs: int = 256, max_model_len: int | None = None, extra: list[str] = ()) -> list[str]:
    """The vLLM OpenAI server command for weight-synced rollouts. A host other than loopback needs VLLM_API_KEY."""
    if host not in LOOPBACK and not api_key():
        raise UserError(f"--host {host}: the server's weight-sync endpoints would accept weights from the network; "
                        "set VLLM_API_KEY (the kit's client sends it) or bind 127.0.0.1")
    return [sys.executable, "-m", "verl_kit.rollout.vllm_server", "api-server", "--model", model_path, "--host", host,
            "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            *(["--max-model-len", str(max_model_len)] if max_model_len else []),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
            # CPU: no chunked prefill, as for the colocated engine (rollout.vllm_engine.VLLMColocated): a seeded request
            # whose prompt is prefilled in pieces kills a CPU engine.
            *([] if torch.cuda.is_available() else ["--enforce-eager", "--no-enable-chunked-prefill"]), *extra]


def auth_headers() -> dict:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _api_server(argv: list[str]) -> None:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server ARGV`), with the API key, when set,
    required on every path: vLLM's middleware reads its GUARDED_PREFIX at each request."""
    import runpy

    if api_key():
        from vllm.entrypoints.serve.middleware import authenticate

        authenticate.GUARDED_PREFIX = ("/",)
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def serve_env(kv_cache_gib: int = 1) -> dict:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # /collective_rpc and /reset_prefix_cache for the weight sync
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    return env


def _terminate_with_parent() -> None:
    """In the server's child process before exec (Linux): SIGTERM it when the process that started it dies, even by
    SIGKILL, when atexit and `stop()` never run. The server then shuts its engine core down itself."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# The guard's program (run by `python -I`: it loads psutil and nothing of the kit, no torch; 14 MB). argv:
# trainer pid, grace seconds, the slot folder. Lines on stdin, `KIND KEY ARGS`:
#   watch KEY PID...    processes that appear under the trainer from now on, other than PID..., are KEY's (polled)
#   settle KEY PID...   PID... are KEY's; stop polling for KEY
#   group KEY PGID      process group PGID (a server started in a session of its own) is KEY's
#   forget KEY          KEY was stopped normally: nothing of it to stop any more
# When the trainer is gone (pidfd readable): SIGKILL what is still recorded, but what ignores SIGTERM and the process
# groups get the grace first (see stop_all); remove the trainer's weight-sync slots; exit. Processes are psutil
# handles, so a recycled pid is never signalled.
_GUARD_PROGRAM = r"""
import os, re, select, signal, sys, time
import psutil

trainer, grace_s, slot_dir = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
me = os.getpid()
procs, groups, watching = {}, {}, {}  # key -> {pid: Process}; key -> (pgid, leader Process or None); key -> set


def say(text):
    try:
        print(f"[verl_kit guard {me}] {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the trainer's stderr may be gone with it
        pass


def record(key, pids):
    mine = procs.setdefault(key, {})
    for pid in pids:
        if pid != me and pid not in mine:
            try:
                mine[pid] = psutil.Process(pid)
            except psutil.Error:
                pass


def poll():
    try:
        now = {p.pid for p in psutil.Process(trainer).children(recursive=True)}
    except psutil.Error:
        return
    for key, before in watching.items():
        record(key, now - before)


def handle(line):
    kind, key, *args = line.split()
    pids = [int(a) for a in args]
    if kind == "watch":
        watching[key] = set(pids) | {me}
        poll()
    elif kind == "settle":  # the watch's processes, as the trainer saw them when it ended
        watching.pop(key, None)
        mine = procs.setdefault(key, {})
        for pid in set(mine) - set(pids):  # polled after the watch ended but before this line was read
            del mine[pid]
        record(key, pids)
    elif kind == "group":
        try:
            leader = psutil.Process(pids[0])
        except psutil.Error:
            leader = None
        groups[key] = (pids[0], leader)
    elif kind == "forget":
        for d in (procs, groups, watching):
            d.pop(key, None)


def alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def members(pgid):
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def ours(pgid, leader):
    # The group's leader as recorded, or no process with its pid (a pid stays taken while its group has members).
    if psutil.pid_exists(pgid):
        return leader is not None and leader.is_running()
    return True


def read_lines(data):
    global buf
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if line.strip():
            try:
                handle(line.decode())
            except Exception as e:
                say(f"ignored {line!r}: {e!r}")


def ignores_sigterm(p):
    try:
        with open(f"/proc/{p.pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
        return bool(mask >> (signal.SIGTERM - 1) & 1)
    except (OSError, StopIteration, ValueError):
        return False


def kill(targets, pgids, sig):
    for p in targets:
        try:
            p.send_signal(sig)  # psutil: never a process that took a recorded pid over
        except psutil.Error:
            pass
    for g in pgids:
        try:
            os.killpg(g, sig)
        except OSError:
            pass


def wait(targets, pgids, seconds):
    deadline = time.time() + seconds
    while True:
        targets, pgids = [p for p in targets if alive(p)], [g for g in pgids if members(g)]
        if not (targets or pgids) or time.time() >= deadline:
            return targets, pgids
        time.sleep(0.1)


def stop_all():
    os.set_blocking(0, False)  # what the trainer wrote before it died (a `forget`, a `settle`) counts
    try:
        while data := os.read(0, 65536):
            read_lines(data)
    except (BlockingIOError, OSError):
        pass
    targets = [p for d in procs.values() for p in d.values() if alive(p)]
    pgids = sorted({g for g, leader in groups.values() if ours(g, leader) and members(g)})
    now = [p for p in targets if not ignores_sigterm(p)]
    rest = [p.pid for p in targets if p not in now]
    if targets or pgids:
        say(f"trainer {trainer} is gone, stopping what it started: SIGKILL to processes {[p.pid for p in now]}; "
            f"{grace_s:g}s to exit for processes {rest} and process groups {pgids}")
    # An engine's processes have no client any more: SIGKILL (vLLM's own SIGTERM shutdown takes 5 to 15 s on CPU).
    # Those that ignore SIGTERM (multiprocessing's resource tracker: it unlinks the shared memory the killed ones
    # leaked, once they are gone) and a server's group (SIGTERMed by the kernel with the trainer: the server stops its
    # engine itself) get the grace, then SIGKILL.
    kill(now, [], signal.SIGKILL)
    targets, pgids = wait(targets, pgids, grace_s)
    kill(targets, pgids, signal.SIGKILL)
    wait(targets, pgids, 5.0)
    remove_slots()


def remove_slots():
    # The trainer's weight-sync slots: nothing maps them any more; removed now rather than at the next run's sweep.
    try:
        if psutil.Process(trainer).create_time() != trainer_started:
            return  # its pid is another process's now, which may have slots of its own
    except psutil.Error:
        pass
    try:
        names = os.listdir(slot_dir)
    except OSError:
        return
    pattern = re.compile(rf"{trainer}-[0-9a-f]{{32}}\.safetensors")
    for name in names:
        if pattern.fullmatch(name):
            try:
                os.unlink(os.path.join(slot_dir, name))
            except OSError:
                pass


try:
    death = os.pidfd_open(trainer)
except (AttributeError, OSError):
    death = None
try:
    trainer_started = psutil.Process(trainer).create_time()
except psutil.Error:
    trainer_started = None
fds, buf = [0], b""
while os.getppid() == trainer:
    try:
        ready = select.select(fds + ([death] if death is not None else []), [], [],
                              0.5 if watching or death is None else None)[0]
        if death is not None and death in ready:
            break
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                fds = []  # the trainer closed its end (it exits): wait for it to be gone
            read_lines(data)
        if watching:
            poll()
    except Exception as e:  # a bad line, a /proc hiccup: never leave the trainer unguarded (nor stop anything) for it
        say(f"ignored: {e!r}")
        time.sleep(0.5)
stop_all()
"""


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


class OrphanGuard:
    """Stops what this process started (a colocated engine's core and workers, a run's server and its workers) when
    this process dies, even by SIGKILL, when no finalizer runs. vLLM starts its engine core as a child of this process
    and the workers as the core's children, and nothing in them watches this process: a killed trainer left them
    running, reparented to PID 1, with their memory (and, on a GPU, their CUDA contexts). A parent-death signal
    (PR_SET_PDEATHSIG) can only be asked for by the child itself, so one small process (the guard, `_GUARD_PROGRAM`)
    watches this one through a pidfd; when it is gone, the guard SIGKILLs the engine processes it was told about (a
    process that ignores SIGTERM, multiprocessing's resource tracker, and a server's process group, which the kernel
    SIGTERMs, get `grace_s` seconds to go by themselves first), removes this process's weight-sync slots
    (verl_kit.rollout.weight_sync.SharedBuckets) and exits. It acts on nothing else: on the processes that appeared
    under this one (by parent chain) while an engine started (`watch`), on process groups (`group`), and not on a part
    stopped normally (`forget`). It runs in a session of its own (a Ctrl-C or a kill of this process's group does not
    stop it first) and lives exactly as long as this process. One per process (`orphan_guard()`): with several
    training processes, each guards its own."""

    def __init__(self, grace_s: float = 5.0):
        slots = slot_dir()
        self.owner = os.getpid()
        # The program travels in the environment, so that `ps` shows one line that names it.
        launch = "import os; exec(os.environ.pop('VERL_KIT_ORPHAN_GUARD'))  # verl_kit.rollout.vllm_server.OrphanGuard"
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", launch, str(self.owner), str(grace_s), slots],
                                     env=dict(os.environ, VERL_KIT_ORPHAN_GUARD=_GUARD_PROGRAM),
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        self._lock = threading.Lock()
        self._warned = False

    def _send(self, *words) -> None:
        with self._lock:
            try:
                self.proc.stdin.write((" ".join(map(str, words)) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                if not self._warned:
                    self._warned = True
                    logger.warning("the orphan guard (pid %d) is gone: a killed run may leave vLLM processes behind",
                                   self.proc.pid)

    @contextlib.contextmanager
    def watch(self, key: str):
        """The processes that appear under this one while the block runs (an engine's, by parent chain) are `key`'s.
        The guard also polls while it runs, so a kill during a long engine start is covered too."""
        before = _descendants()
        self._send("watch", key, *before)
        try:
            yield
        finally:
            self._send("settle", key, *(_descendants() - before - {self.proc.pid}))

    def group(self, key: str, pgid: int) -> None:
        """Process group `pgid` (a process started in a session of its own, with everything it starts) is `key`'s."""
        self._send("group", key, pgid)

    def forget(self, key: str) -> None:
        self._send("forget", key)


_guard: OrphanGuard | None = None
_guard_lock = threading.Lock()


def orphan_guard() -> OrphanGuard:
    """This process's guard, started on first use."""
    global _guard
    with _guard_lock:
        if _guard is None or _guard.owner != os.getpid():  # not a guard inherited through a fork
            _guard = OrphanGuard()
        return _guard


class ServerProcess:
    """A vLLM server started for a run: `with ServerProcess(path) as server: VLLMServer(server.url, tok)`.
    Startup waits for /health (up to startup_timeout_s) and fails with the log's tail if the server exits first.
    The server is stopped by stop() (atexit in rollout.backends.start_server), or, when the starting process dies
    (SIGKILL included), by the parent-death SIGTERM the kernel sends it and by this process's `OrphanGuard`, which
    SIGKILLs the server's process group (the server, its engine core, its workers) if any of it is left after its
    grace."""

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int | None = None,
                 startup_timeout_s: float = 600, log_path: str | None = None, kv_cache_gib: int = 1, **serve_kwargs):
        import requests

        self.port = port or free_port()
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = log_path or os.path.join("/tmp", f"verl_kit_vllm_{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = serve_command(model_path, self.port, host=host, **serve_kwargs)
        guard = orphan_guard()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=serve_env(kv_cache_gib),
                                     start_new_session=True, preexec_fn=_terminate_with_parent)
        self._guard_key = f"server-{self.proc.pid}"
        guard.group(self._guard_key, self.proc.pid)  # the server leads its group: its engine core and workers in it
        deadline = time.time() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = open(self.log_path).read()[-3000:]
                self.stop()
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} while starting:\n{tail}")
            try:
                if requests.get(self.url + "/health", timeout=2, headers=auth_headers()).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM server not healthy after {startup_timeout_s}s; log: {self.log_path}")
            time.sleep(1)
        logger.info("vLLM server ready at %s (log %s)", self.url, self.log_path)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the server's process group, SIGKILL it if it is not gone within timeout_s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # the engine core and workers share the group; make sure none outlives the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        orphan_guard().forget(self._guard_key)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str]) -> None:
    """`serve`: run a weight-syncable vLLM server in the foreground (what `make vllm-serve` calls). `api-server`:
    the server process itself (serve_command's target)."""
    import argparse

    if argv[:1] == ["api-server"]:
        return _api_server(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m verl_kit.rollout.vllm_server")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("--model", required=True, help="path, hub name or tiny-llama")
    ap.add_argument("--host", default="127.0.0.1", help="other than loopback only with VLLM_API_KEY set")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max_num_seqs", type=int, default=256)
    ap.add_argument("--max_model_len", type=int, default=None, help="default: the model's maximum")
    ap.add_argument("--kv_cache_gib", type=int, default=1, help="KV cache on CPU (VLLM_CPU_KVCACHE_SPACE)")
    args, extra = ap.parse_known_args(argv)
    path = resolve_model_path(args.model)
    cmd = serve_command(path, args.port, host=args.host, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, extra=extra)
    print(" ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, serve_env(args.kv_cache_gib))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
