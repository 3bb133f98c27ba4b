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

import logging
import os
import socket
import sys
import time

import torch

from verl_kit.errors import UserError
from verl_kit.launch.processes import GuardedGroup
from verl_kit.models.loading import resolve_model_path
from verl_kit.rollout.synced import orphan_guard
from verl_kit.rollout.worker_extension import WORKER_EXTENSION

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback_url(url: str) -> bool:
    """A server URL on this host's loopback (the server then shares this host's /dev/shm: weight buckets go through
    files there, verl_kit.rollout.transport.SharedBuckets)."""
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


class ServerProcess:
    """A vLLM server started for a run: `with ServerProcess(path) as server: VLLMServer(server.url, tok)`.
    Startup waits for /health (up to startup_timeout_s) and fails with the log's tail if the server exits first.
    The server leads a process group of its own (verl_kit.launch.processes.GuardedGroup: its engine core and workers
    in it) and is stopped by stop() (atexit in rollout.backends.start_server), or, when the starting process dies
    (SIGKILL included), by the parent-death SIGTERM the kernel sends it and by this process's orphan guard, which
    SIGKILLs the group if any of it is left after its grace."""

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int | None = None,
                 startup_timeout_s: float = 600, log_path: str | None = None, kv_cache_gib: int = 1, **serve_kwargs):
        import requests

        self.port = port or free_port()
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = log_path or os.path.join("/tmp", f"verl_kit_vllm_{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = serve_command(model_path, self.port, host=host, **serve_kwargs)
        self.group = GuardedGroup(cmd, env=serve_env(kv_cache_gib), log=self.log, guard=orphan_guard())
        self.proc = self.group.proc
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
        self.group.stop(timeout_s)
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
