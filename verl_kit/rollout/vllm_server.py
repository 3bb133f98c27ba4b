"""The vLLM OpenAI server a run (or `make vllm-serve`) starts for weight-synced rollouts: its command, environment, key
and process lifecycle. The client side is verl_kit.rollout.vllm_client.VLLMServer.

    python -m verl_kit.rollout.vllm_server serve --model tiny-llama --port 8000     # what `make vllm-serve` runs
    VLLM_API_KEY=... python -m verl_kit.rollout.vllm_server serve --model PATH --host 0.0.0.0

The weight sync needs vLLM's dev endpoints (its weight-transfer routes, /reset_prefix_cache; /collective_rpc and /sleep
come with them), which can replace the model's weights or make it write them to files, and vLLM's own --api-key
guards only /v1, /v2, /inference and /cohere.
So every server the kit starts requires a key on every path, on loopback too (any local user, or a container on the
host network, reaches 127.0.0.1): `RequireKey`, loaded through vLLM's public --middleware option. A run's own server
gets a fresh random key (as Jupyter does), handed only to the run's own clients (`use_key`); `make vllm-serve` uses
VLLM_API_KEY when set, else a fresh one it writes to a 0600 file and tells how to pass. The key travels to the
server in its environment (VLLM_API_KEY), never on a command line, which every local user can read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import time

import torch

from verl_kit.errors import UserError
from verl_kit.launch.processes import GuardedGroup
from verl_kit.models.loading import resolve_model_path
from verl_kit.rollout.synced import WEIGHT_TRANSFER_CONFIG, WORKER_EXTENSION, orphan_guard, vllm_lora_rank

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# ---- the key ------------------------------------------------------------------------------------------------------

# Server URL -> the key of a server this process started (ServerProcess) or was handed by its run (start_servers).
# Held here, never in os.environ: nothing the run starts (reward workers, tools, a shell) inherits it.
_KEYS: dict[str, str] = {}


def new_key() -> str:
    """A fresh server key: 256 random bits."""
    return secrets.token_urlsafe(32)


def use_key(url: str, key: str) -> None:
    """Hand this process's clients of the server at `url` its key."""
    _KEYS[url.rstrip("/")] = key


def key_for(url: str) -> str | None:
    """The key a client sends to the server at `url`: the one this process was handed for it (its run's own server),
    else VLLM_API_KEY (a server started by `make vllm-serve`, on this host or another)."""
    return _KEYS.get(url.rstrip("/")) or os.environ.get("VLLM_API_KEY") or None


def auth_headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---- TLS ------------------------------------------------------------------------------------------------------------

# Server URL -> the CA file its clients verify it with: a server this process started with a certificate of its own.
_CAS: dict[str, str] = {}


def use_ca(url: str, ca_file: str) -> None:
    """Hand this process's clients of the server at `url` the CA file (or self-signed certificate) that verifies it."""
    _CAS[url.rstrip("/")] = ca_file


def verify_for(url: str, ca_file: str | None = None) -> str | bool:
    """What a client checks the server at `url` against (requests' `verify`): `ca_file` (--vllm_server_ca_file), else
    the one this process was handed for it, else the system's CAs."""
    return ca_file or _CAS.get(url.rstrip("/")) or True


def server_url(host: str, port: int, tls: bool) -> str:
    """The URL clients on this host use for a server bound to `host` (a wildcard bind: loopback)."""
    return f"{'https' if tls else 'http'}://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def is_loopback_host(host: str) -> bool:
    return is_loopback_url(f"http://{host}:1") if ":" not in host else host == "::1"


def self_signed_certificate(hosts: list[str], folder: str, days: int = 30) -> tuple[str, str]:
    """A fresh P-256 key and a certificate for `hosts` (IP addresses or names) signed by it, written into `folder` as
    cert.pem and key.pem (mode 600): a server's --ssl_certfile/--ssl_keyfile, and the certificate is the CA file its
    clients verify it with (--vllm_server_ca_file). What a cluster job gives the servers it places."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(h):
        try:
            return x509.IPAddress(ipaddress.ip_address(h))
        except ValueError:
            return x509.DNSName(h)

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"verl-kit vLLM server {hosts[0]}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([name(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with _private_file(key_path) as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()).decode())
    with _private_file(cert_path) as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM).decode())
    return cert_path, key_path


def check_exposure(host: str, ssl_certfile: str | None, ssl_keyfile: str | None, allow_insecure_http: bool,
                   extra: list[str] = (), ca_flag: str = "--vllm_server_ca_file") -> None:
    """A server beyond loopback speaks TLS (its key and the weights would cross the network in clear otherwise), or
    is told `--allow_insecure_http` (one warning line). One-line errors. (`extra`: flags for vLLM itself, where its
    own spelling of the TLS flags is refused: the kit must know the server speaks https.)"""
    for a in extra:
        if (flag := a.split("=")[0]) in ("--ssl-certfile", "--ssl-keyfile"):
            raise UserError(f"{flag}: pass --{flag[2:].replace('-', '_')} instead (the kit checks it and gives the "
                            "URL https)")
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise UserError("--ssl_certfile and --ssl_keyfile go together")
    for flag, path in (("--ssl_certfile", ssl_certfile), ("--ssl_keyfile", ssl_keyfile)):
        if path and not os.path.isfile(path):
            raise UserError(f"{flag} {path}: no such file")
    if ssl_certfile or is_loopback_host(host):
        return
    if not allow_insecure_http:
        raise UserError(f"--host {host}: beyond loopback the server's key would cross the network in clear: pass "
                        f"--ssl_certfile and --ssl_keyfile (TLS; clients verify it with {ca_flag}), or "
                        "--allow_insecure_http on a network you trust")
    logger.warning("--allow_insecure_http: the server on %s takes its key and serves its API in clear", host)


MIDDLEWARE = "verl_kit.rollout.vllm_server.RequireKey"  # its import path: under `python -m` __name__ is __main__


class RequireKey:
    """ASGI middleware of the kit's server (vLLM's `--middleware`, so it wraps every route, mount and dev endpoint):
    a request without `Authorization: Bearer <VLLM_API_KEY>` gets 401 on every path and method, /collective_rpc,
    /health, /metrics and OPTIONS included (a websocket is closed before it is accepted). Refuses to start without
    a key (`key`, else VLLM_API_KEY; the reward server, verl_kit.rewards.serve, passes its own)."""

    def __init__(self, app, key: str | None = None):
        key = key or os.environ.get("VLLM_API_KEY")
        if not key:
            raise RuntimeError("verl_kit RequireKey: VLLM_API_KEY is not set in the server's environment")
        self.app = app
        self.digest = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def allowed(self, scope) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b'{"error": "Unauthorized: this server needs its key"}'})


def serve_command(model_path: str, port: int, *, host: str = "127.0.0.1", dtype: str = "auto",
                  max_num_seqs: int = 256, max_model_len: int | None = None, ssl_certfile: str | None = None,
                  ssl_keyfile: str | None = None, lora_rank: int | None = None, extra: list[str] = ()) -> list[str]:
    """The vLLM OpenAI server command for weight-synced rollouts; its key comes from serve_env. `lora_rank`: the
    server also serves LoRA adapters up to that rank, loaded at run time (the adapter-only sync; serve_env)."""
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise UserError("--api-key: pass the server's key as VLLM_API_KEY instead (a command line is readable by "
                        "every user of the machine)")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host,
            "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            *(["--max-model-len", str(max_model_len)] if max_model_len else []),
            *(["--ssl-certfile", ssl_certfile, "--ssl-keyfile", ssl_keyfile] if ssl_certfile else []),
            *(["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(vllm_lora_rank(lora_rank))]
              if lora_rank else []),
            "--worker-extension-cls", WORKER_EXTENSION, "--weight-transfer-config", json.dumps(WEIGHT_TRANSFER_CONFIG),
            "--middleware", MIDDLEWARE, "--enable-scale-out",  # vLLM's token-in-token-out /inference/v1/generate
            "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
            # CPU: no chunked prefill, as for the colocated engine (rollout.vllm_engine.VLLMColocated): a seeded request
            # whose prompt is prefilled in pieces kills a CPU engine.
            *([] if torch.cuda.is_available() else ["--enforce-eager", "--no-enable-chunked-prefill"]), *extra]


def serve_env(key: str, kv_cache_gib: int = 1, lora: bool = False) -> dict:
    """The server's environment: its key (RequireKey and vLLM's own /v1 check read VLLM_API_KEY), the dev
    endpoints the weight sync uses (vLLM's weight-transfer routes, /reset_prefix_cache) and, with `lora`, vLLM's
    /v1/load_lora_adapter (the adapter-only sync)."""
    if not key:
        raise ValueError("a kit vLLM server needs a key")
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=key)
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    return env


class ServerProcess:
    """A vLLM server started for a run: `with ServerProcess(path) as server: VLLMServer(server.url, tok)`.
    Startup waits for /health (up to startup_timeout_s) and fails with the log's tail if the server exits first.
    The server leads a process group of its own (verl_kit.launch.processes.GuardedGroup: its engine core and workers
    in it) and is stopped by stop() (atexit in rollout.backends.start_servers), or, when the starting process dies
    (SIGKILL included), by the parent-death SIGTERM the kernel sends it and by this process's orphan guard, which
    SIGKILLs the group if any of it is left after its grace."""

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int | None = None,
                 startup_timeout_s: float = 600, log_path: str | None = None, kv_cache_gib: int = 1,
                 wait: bool = True, api_key: str | None = None, allow_insecure_http: bool = False,
                 **serve_kwargs):
        """Start the server; with `wait` (default) return once it is healthy, else call wait_ready() (several servers
        start together: spawn each here, from the thread that keeps running, then wait for each; the kernel's
        parent-death signal follows the thread that spawned a process, so a worker thread that ends would stop it)."""
        check_exposure(host, serve_kwargs.get("ssl_certfile"), serve_kwargs.get("ssl_keyfile"), allow_insecure_http)
        self.port = port or free_port()
        self.ca_file = serve_kwargs.get("ssl_certfile")  # a certificate of its own: its clients verify it with it
        self.url = server_url(host, self.port, bool(self.ca_file))
        if self.ca_file:
            use_ca(self.url, self.ca_file)
        # its own fresh key unless given one (several servers behind one VLLM_API_KEY); never VLLM_API_KEY itself,
        # which may be another server's
        self.api_key = api_key or new_key()
        use_key(self.url, self.api_key)
        self.log_path = log_path or os.path.join("/tmp", f"verl_kit_vllm_{self.port}.log")
        self.log = _private_file(self.log_path)  # prompts and errors: for this user only
        cmd = self.command(model_path, host, serve_kwargs)
        env = serve_env(self.api_key, kv_cache_gib, lora=bool(serve_kwargs.get("lora_rank")))
        self.group = GuardedGroup(cmd, env=env, log=self.log, guard=orphan_guard())
        self.proc = self.group.proc
        self.deadline, self.startup_timeout_s = time.time() + startup_timeout_s, startup_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for /health, up to the startup timeout; fail with the log's tail if the server exits first."""
        import requests

        while True:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = open(self.log_path).read()[-3000:]
                self.stop()
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} while starting:\n{tail}")
            try:
                if requests.get(self.url + "/health", timeout=2, headers=auth_headers(self.api_key),
                                verify=verify_for(self.url)).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > self.deadline:
                self.stop()
                raise RuntimeError(f"vLLM server not healthy after {self.startup_timeout_s}s; log: {self.log_path}")
            time.sleep(1)
        logger.info("vLLM server ready at %s (log %s)", self.url, self.log_path)

    def command(self, model_path: str, host: str, serve_kwargs: dict) -> list[str]:
        """What starts the server (serve_command; the tests' shared server runs `make vllm-serve` instead, the
        command a user types, which ends in the same one)."""
        return serve_command(model_path, self.port, host=host, **serve_kwargs)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the server's process group, SIGKILL it if it is not gone within timeout_s."""
        self.group.stop(timeout_s)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _private_file(path: str):
    """`path` opened for writing, truncated, readable by this user only (also when it existed with a wider mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def key_file(port: int, kind: str = "vllm-serve") -> str:
    """Where `make vllm-serve` (or another `kind` of server: "reward-serve") keeps the key of the server on `port`
    when it made one: in a 0700 folder of the kit's cache (VERL_KIT_CACHE)."""
    from verl_kit.models.loading import cache_dir

    folder = os.path.join(cache_dir(), kind)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    return os.path.join(folder, f"{port}.key")


def check_port_free(host: str, port: int) -> None:
    """A one-line error when `host:port` is taken (a server already running there)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"--port {port}: {host}:{port} is taken ({e.strerror}); is a server already running "
                            "there?") from None


def server_key(env: str, port: int, kind: str) -> tuple[str, str | None]:
    """A standalone server's key: the environment variable `env` when set (-> (key, None)), else a fresh one
    written to key_file(port, kind), readable by this user only (-> (key, that file))."""
    if key := os.environ.get(env):
        return key, None
    key, where = new_key(), key_file(port, kind)
    with _private_file(where) as f:
        f.write(key + "\n")
    return key, where


def main(argv: list[str]) -> None:
    """`serve`: run a weight-syncable vLLM server in the foreground (what `make vllm-serve` calls), with the key in
    VLLM_API_KEY, or a fresh one written to key_file(port); it prints how a run passes the key."""
    import argparse
    import shlex

    ap = argparse.ArgumentParser(prog="python -m verl_kit.rollout.vllm_server")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("--model", required=True, help="path, hub name or tiny-llama")
    ap.add_argument("--host", default="127.0.0.1", help="bind address; the key is required on every one")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max_num_seqs", type=int, default=256)
    ap.add_argument("--max_model_len", type=int, default=None, help="default: the model's maximum")
    ap.add_argument("--kv_cache_gib", type=int, default=1, help="KV cache on CPU (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--ssl_certfile", default=None, help="TLS certificate (PEM): the server speaks https")
    ap.add_argument("--ssl_keyfile", default=None, help="its private key (PEM)")
    ap.add_argument("--lora_rank", type=int, default=None,
                    help="also serve LoRA adapters up to this rank (a run's --vllm_lora_sync adapter)")
    ap.add_argument("--allow_insecure_http", action="store_true",
                    help="beyond loopback without TLS: the key crosses the network in clear (refused otherwise)")
    args, extra = ap.parse_known_args(argv)
    check_exposure(args.host, args.ssl_certfile, args.ssl_keyfile, args.allow_insecure_http, extra)
    path = resolve_model_path(args.model)
    cmd = serve_command(path, args.port, host=args.host, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, ssl_certfile=args.ssl_certfile,
                        ssl_keyfile=args.ssl_keyfile, lora_rank=args.lora_rank, extra=extra)
    url = server_url(args.host, args.port, bool(args.ssl_certfile))
    check_port_free(args.host, args.port)  # before a fresh key replaces the key file of a server already there
    key, where = server_key("VLLM_API_KEY", args.port, "vllm-serve")
    if where is None:
        how = "the same VLLM_API_KEY in its environment"
        run = ""
    else:
        how = f"its key (in {where}, readable by you only)"
        run = f"VLLM_API_KEY=$(cat {shlex.quote(where)}) "
    print(" ".join(cmd), flush=True)
    ca = (f"\n(a self-signed certificate: add --vllm_server_ca_file {shlex.quote(os.path.abspath(args.ssl_certfile))}"
          ")") if args.ssl_certfile else ""
    print(f"\nThis server requires its key on every request. A run reaches it with {how}:\n"
          f"    {run}python recipes/ppo.py --rollout vllm-server --vllm_server_url {url}{ca}\n"
          "(from another host: the same key in VLLM_API_KEY and this host's address in the URL)\n", flush=True)
    os.execve(cmd[0], cmd, serve_env(key, args.kv_cache_gib, lora=bool(args.lora_rank)))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
