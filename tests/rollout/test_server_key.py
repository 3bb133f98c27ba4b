"""The run's own vLLM server (a run's `--rollout vllm-server` without a URL, `make vllm-serve`) requires a key on
every path, loopback included: vLLM's own --api-key guards only /v1, /v2, /inference and /cohere, which leaves
/collective_rpc (it replaces the weights, or writes them to files) and the other dev endpoints open to any local
user. On the session's shared server (conftest.vllm_server): keyless and wrong-key requests are refused with 401; the
kit's own client, given the key by the process that started the server, works (test_vllm's server tests)."""

from __future__ import annotations

import os
import socket
import stat
import tempfile

import pytest


@pytest.mark.slow
@pytest.mark.vllm
def test_the_run_server_refuses_requests_without_its_key(vllm_server, tokenizer):
    """The issue's reproduction first (a keyless POST of {"method": "verl_kit_commit"} to /collective_rpc answered
    200 on main), then the other dev endpoints, /v1, /health, /metrics and the API docs, keyless and with a wrong key
    or scheme. The key is nowhere a local user can read it: not in the server's command line, not in its log."""
    import psutil
    import requests

    from verl_kit.errors import UserError
    from verl_kit.rollout import VLLMServer

    url = vllm_server.url
    calls = {"POST /collective_rpc": ("POST", "/collective_rpc", {"method": "verl_kit_commit"}),
             "POST /reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
             "GET /server_info": ("GET", "/server_info", None),
             "GET /is_sleeping": ("GET", "/is_sleeping", None),
             "GET /v1/models": ("GET", "/v1/models", None),
             "POST /tokenize": ("POST", "/tokenize", {"prompt": "hello"}),
             "GET /health": ("GET", "/health", None),
             "GET /metrics": ("GET", "/metrics", None),
             "GET /openapi.json": ("GET", "/openapi.json", None),
             "OPTIONS /collective_rpc": ("OPTIONS", "/collective_rpc", None)}
    key = getattr(vllm_server, "api_key", "")
    wrong = [{}, {"Authorization": "Bearer not-the-key"}, {"Authorization": f"Basic {key}"}]
    got = {f"{name} {h}": requests.request(m, url + path, json=body, headers=h, timeout=30,
                                           verify=vllm_server.ca_file).status_code
           for name, (m, path, body) in calls.items() for h in wrong}
    assert got["POST /collective_rpc {}"] == 401, got  # the reproduction: 200 on main
    assert set(got.values()) == {401}, got
    assert len(key) >= 32
    ok = requests.get(url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      verify=vllm_server.ca_file)
    assert ok.status_code == 200
    assert key not in " ".join(psutil.Process(vllm_server.proc.pid).cmdline())
    assert key not in open(vllm_server.log_path).read()
    assert stat.S_IMODE(os.stat(vllm_server.log_path).st_mode) == 0o600
    # A client with a wrong key is told what to set, in one line (not "no vLLM server answers").
    with pytest.raises(UserError, match="VLLM_API_KEY"):
        VLLMServer(url, tokenizer, api_key="not-the-key", connect_timeout_s=5, max_retries=0)
    # The server speaks TLS (a self-signed certificate): a client that does not trust it is told, in one line, which
    # flag to pass (not retried as if the server were down)
    from verl_kit.rollout.vllm_server import self_signed_certificate

    assert url.startswith("https://")
    other, _ = self_signed_certificate(["127.0.0.1"], tempfile.mkdtemp())
    with pytest.raises(UserError, match=r"its TLS certificate does not verify \(.+\): pass the CA file that signed "
                                        r"it .* as --vllm_server_ca_file$"):
        VLLMServer(url, tokenizer, ca_file=other, connect_timeout_s=5, max_retries=3)


def test_make_vllm_serve_makes_a_key_and_says_how_to_pass_it(tiny_model_path, tmp_path, monkeypatch, capsys):
    """`make vllm-serve` (`python -m verl_kit.rollout.vllm_server serve`) without VLLM_API_KEY: the server's
    environment gets a fresh key, written to a 0600 file in a 0700 folder and nowhere on the command line; the
    printed line tells a run how to pass it. With VLLM_API_KEY set, that key. (On main the server got no key.)"""
    from verl_kit.rollout import vllm_server

    started = []

    def execve(path, argv, env):  # the server process itself is not started here
        started.append((argv, env))

    monkeypatch.setattr(vllm_server.os, "execve", execve)
    monkeypatch.setenv("VERL_KIT_CACHE", str(tmp_path))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8123"])
    (argv, env), = started
    key = env["VLLM_API_KEY"]
    path = tmp_path / "vllm-serve" / "8123.key"
    assert len(key) >= 32 and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert key not in " ".join(argv) and "verl_kit.rollout.vllm_server.RequireKey" in argv
    out = capsys.readouterr().out
    assert key not in out
    assert f"VLLM_API_KEY=$(cat {path}) python recipes/ppo.py --rollout vllm-server --vllm_server_url " \
           "http://127.0.0.1:8123" in out, out
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    # `VLLM_ARGS='--lora_rank 12'`: a server that also loads LoRA adapters at run time (--vllm_lora_sync adapter),
    # in vLLM's next rank slot
    vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8123", "--lora_rank", "12"])
    argv, env = started.pop()
    assert argv[argv.index("--enable-lora"):][:5] == ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"

    from verl_kit.errors import UserError

    monkeypatch.setenv("VLLM_API_KEY", "the-users-own-key")
    # beyond loopback: TLS, or an explicit --allow_insecure_http (one warning line)
    with pytest.raises(UserError, match=r"^--host 0.0.0.0: beyond loopback the server's key would cross the network "
                                        r"in clear: pass --ssl_certfile and --ssl_keyfile"):
        vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8124", "--host", "0.0.0.0"])
    cert, tls_key = vllm_server.self_signed_certificate(["127.0.0.1"], str(tmp_path / "tls"))
    assert stat.S_IMODE(os.stat(tls_key).st_mode) == 0o600
    vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8124", "--host", "0.0.0.0", "--ssl_certfile",
                      cert, "--ssl_keyfile", tls_key])
    argv = started[-1][0]
    assert argv[argv.index("--ssl-certfile") + 1] == cert and argv[argv.index("--ssl-keyfile") + 1] == tls_key
    assert started[-1][1]["VLLM_API_KEY"] == "the-users-own-key"
    assert not (tmp_path / "vllm-serve" / "8124.key").exists()
    out = capsys.readouterr().out
    assert f"--vllm_server_url https://127.0.0.1:8124\n(a self-signed certificate: add --vllm_server_ca_file {cert}" \
        in out, out
    for bad, why in ((["--ssl_certfile", cert], "--ssl_certfile and --ssl_keyfile go together"),
                     (["--ssl_certfile", cert, "--ssl_keyfile", "/nonexistent.pem"], "--ssl_keyfile /nonexistent.pem: "
                                                                                      "no such file"),
                     (["--ssl-certfile", cert], "--ssl-certfile: pass --ssl_certfile instead")):
        with pytest.raises(UserError, match=why):
            vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8125", "--host", "10.1.2.3", *bad])
    vllm_server.main(["serve", "--model", tiny_model_path, "--port", "8124", "--host", "0.0.0.0",
                      "--allow_insecure_http"])
    assert len(started) == 3

    with pytest.raises(UserError, match="VLLM_API_KEY"):  # a key on the command line is readable by every user
        vllm_server.main(["serve", "--model", tiny_model_path, "--api-key", "x"])
    monkeypatch.delenv("VLLM_API_KEY")
    with socket.socket() as taken:  # a second `make vllm-serve` on a busy port keeps the first one's key file
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {port}: .* is taken"):
            vllm_server.main(["serve", "--model", tiny_model_path, "--port", str(port)])
    assert not (tmp_path / "vllm-serve" / f"{port}.key").exists() and len(started) == 3


def test_require_key_guards_every_request_type(monkeypatch):
    """RequireKey as an ASGI app around a stub: HTTP without the key or with another one gets 401 and never
    reaches the app; a websocket is closed (1008) before it is accepted; lifespan events pass; the key passes."""
    import asyncio

    from verl_kit.rollout.vllm_server import RequireKey

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def call(scope):
        sent = []

        async def send(message):
            sent.append(message)

        await guard(scope, None, send)
        return sent

    monkeypatch.setenv("VLLM_API_KEY", "k" * 40)
    guard = RequireKey(app)
    monkeypatch.delenv("VLLM_API_KEY")
    http = {"type": "http", "method": "POST", "path": "/collective_rpc"}
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", b"Basic " + b"k" * 40)]):
        sent = asyncio.run(call({**http, "headers": headers}))
        assert sent[0]["status"] == 401 and reached == []
    assert asyncio.run(call({"type": "websocket", "path": "/v1/realtime", "headers": []})) == \
        [{"type": "websocket.close", "code": 1008}]
    assert asyncio.run(call({"type": "lifespan"})) == [] and reached == ["lifespan"]
    assert asyncio.run(call({**http, "headers": [(b"authorization", b"Bearer " + b"k" * 40)]})) == []
    assert reached == ["lifespan", "http"]
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):  # no key, no server
        RequireKey(app)


KEY_DRIVER = r"""
import json, os, sys
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from verl_kit.rollout import backends, vllm_server

    class Server:  # stands in for a vLLM server process 0 starts (what is checked is who gets its key)
        def __init__(self, *args, extra=(), **kwargs):
            self.url = f"http://127.0.0.1:{9 + int(extra[-1])}"  # its --seed: 0, 1
            self.api_key = vllm_server.new_key()

        def wait_ready(self):
            pass

        def stop(self):
            pass

    backends.ServerProcess = Server
    acc = SimpleNamespace(process_index=rank, num_processes=2, mixed_precision="no")
    vllm = SimpleNamespace(server_urls=[], vllm_num_servers=2, vllm_kv_cache_gib=1, vllm_max_num_seqs=8,
                           vllm_tensor_parallel_size=1)
    servers, urls = backends.start_servers(SimpleNamespace(rollout="vllm-server"), vllm, acc, "model", 64, 0)
    keys = [None, None]
    dist.all_gather_object(keys, [vllm_server.key_for(url) for url in urls])
    if rank == 0:
        out.put({"urls": urls, "keys": keys, "key": [s.api_key for s in servers],
                 "env": os.environ.get("VLLM_API_KEY")})
    dist.destroy_process_group()


if __name__ == "__main__":
    from verl_kit.rollout.vllm_server import free_port

    os.environ.pop("VLLM_API_KEY", None)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(free_port(), out), nprocs=2)
    print("RESULT " + json.dumps(out.get()), flush=True)
"""


@pytest.mark.slow
def test_every_process_of_the_run_gets_its_server_key_and_nothing_else_does():
    """start_servers in a 2-process run (gloo), --vllm_num_servers 2: process 0 makes the servers, each with a key of
    its own; the other process gets their URLs and keys with them, for its own clients (vllm_server.key_for), and
    neither puts a key in its environment, which everything the run starts would inherit."""
    from helpers import run_driver

    out = run_driver(KEY_DRIVER, timeout=120)
    assert out["urls"] == ["http://127.0.0.1:9", "http://127.0.0.1:10"], out
    assert out["keys"] == [out["key"], out["key"]] and len(set(out["key"])) == 2, out
    assert out["env"] is None, out
