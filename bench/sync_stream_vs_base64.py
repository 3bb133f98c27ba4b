"""Weight sync across hosts: the kit's streamed transport (rollout.transport.StreamedBuckets: raw safetensors bytes the
engine's worker pulls over HTTP) against the base64-in-JSON transport it replaced, between two network namespaces
joined by a veth pair (two hosts as far as sockets can tell), then a real sync into a kit vLLM server across them.

    python bench/sync_stream_vs_base64.py                # 64 MiB buckets, 5 rounds each, then the server sync
    python bench/sync_stream_vs_base64.py --server_syncs 0

1. The wire, alternating rounds: the sender (namespace A) gets one bucket of fp32 tensors to the receiver (namespace
   B) as tensors in B's memory. base64: safetensors bytes base64-encoded into a JSON body, POSTed, decoded there (what
   the kit did before, through vLLM's /collective_rpc). stream: the bucket written into the sender's served buffer,
   its reference handed over, the receiver pulling it with the worker's own code (`transport.decode`). stream_tls:
   the same over TLS (what the stream speaks to a server that does: the sender's own certificate, pinned).
2. The sync: the kit's server (`python -m verl_kit.rollout.vllm_server serve`, the bench model) in namespace B on its
   veth address with a key and TLS (a self-signed certificate, as a cluster job gives its servers), the trainer's
   VLLMServer in namespace A, `--vllm_weight_sync_transport auto` (which streams to a non-loopback server, over TLS
   to this one): sync/bytes_per_s of each sync, and the probe.

Summary line: `sync_stream ratio=<stream GB/s / base64 GB/s> ...` with the server sync's GB/s. Needs root (ip netns);
without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import time

import harness as h

NS_A, NS_B, IP_A, IP_B = "vkbenchA", "vkbenchB", "10.231.0.1", "10.231.0.2"


def netns_up() -> None:
    def sh(*cmd):
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    netns_down()
    sh("ip", "netns", "add", NS_A)
    sh("ip", "netns", "add", NS_B)
    sh("ip", "link", "add", "vkbA", "type", "veth", "peer", "name", "vkbB")
    for dev, ns, ip in (("vkbA", NS_A, IP_A), ("vkbB", NS_B, IP_B)):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")


def netns_down() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def in_ns(ns: str, args: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *args]


def receiver() -> None:
    """Namespace B: a base64 endpoint (POST /bucket: JSON {"args": [base64 safetensors]}, decoded to tensors) on
    IP_B:port, and a puller reading stream references from stdin (one per line), answering each with 'ok'."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from safetensors.torch import load

    from verl_kit.rollout import transport

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            tensors = load(base64.b64decode(json.loads(body)["args"][0]))
            assert tensors
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((IP_B, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    for line in sys.stdin:
        tensors, _ = transport.decode(line.strip())
        assert tensors
        print("ok", flush=True)


def sender(args) -> dict:
    """Namespace A: alternate base64 and stream rounds of one bucket to the receiver; seconds of each."""
    import requests
    import torch
    from safetensors.torch import save

    from verl_kit.rollout import transport

    n = int(args.bucket_mb * 2**20 // 4)
    tensors = {f"model.layers.{i}.w": torch.randn(n // 8) for i in range(8)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    recv = subprocess.Popen(in_ns(NS_B, ["--role", "receiver"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        port = int(recv.stdout.readline().split()[1])
        address = transport.local_address_towards(IP_B)
        streams = {"stream": transport.StreamedBuckets(address),
                   "stream_tls": transport.StreamedBuckets(address, tls=True)}
        seconds = {"base64": [], "stream": [], "stream_tls": []}
        for r in range(args.rounds + 1):  # round 0 warms every path up
            for kind in ("base64", "stream", "stream_tls")[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                if kind == "base64":
                    blob = base64.b64encode(save({k: v.contiguous() for k, v in tensors.items()})).decode("ascii")
                    requests.post(f"http://{IP_B}:{port}/bucket", json={"args": [blob]}, timeout=300).raise_for_status()
                else:
                    recv.stdin.write(streams[kind].encode(0, tensors) + "\n")
                    recv.stdin.flush()
                    assert recv.stdout.readline().strip() == "ok"
                if r:
                    seconds[kind].append(time.perf_counter() - t0)
        for stream in streams.values():
            stream.close()
    finally:
        recv.stdin.close()
        recv.wait(timeout=60)
    return {"bytes": nbytes, "seconds": seconds,
            "gb_per_s": {k: nbytes / h.median(v) / 1e9 for k, v in seconds.items()}}


def server_sync(args, path: str) -> dict:
    """Namespace A: the trainer's VLLMServer syncing the bench model into the kit's server in namespace B."""
    import torch

    from verl_kit.models import load_causal_lm, load_tokenizer
    from verl_kit.rollout import VLLMServer
    from verl_kit.rollout.vllm_server import new_key, self_signed_certificate

    key, port = new_key(), 8123
    cert, cert_key = self_signed_certificate([IP_B], str(h.RESULTS / "sync_stream_tls"))
    env = {**os.environ, "VLLM_API_KEY": key, "VLLM_HOST_IP": IP_B, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = ["ip", "netns", "exec", NS_B, sys.executable, "-m", "verl_kit.rollout.vllm_server", "serve", "--model",
           path, "--host", IP_B, "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
           "--ssl_certfile", cert, "--ssl_keyfile", cert_key]
    log = open(h.RESULTS / "sync_stream_server.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        tok = load_tokenizer(path)
        url = f"https://{IP_B}:{port}"
        deadline = time.time() + 600
        while True:
            try:
                client = VLLMServer(url, tok, api_key=key, bucket_mb=args.bucket_mb, connect_timeout_s=5, ca_file=cert,
                                    probe_prompts=[tok("hello there")["input_ids"]], probe_threshold=1e-3)
                break
            except Exception:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the server in {NS_B} did not start: see {log.name}") from None
                time.sleep(5)
        model = load_causal_lm(path, "sdpa")
        calls: dict[str, list[float]] = {}  # seconds per weight-transfer call, for the breakdown
        for name in ("start_weight_update", "update_weights", "finish_weight_update"):
            def timed(*a, _f=getattr(client, name), _n=name):
                t0 = time.perf_counter()
                _f(*a)
                calls.setdefault(_n, []).append(time.perf_counter() - t0)
            setattr(client, name, timed)
        syncs = []
        for i in range(args.server_syncs + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0 + 1e-3)
            calls.clear()
            m = client.load_weights(model, version=i)
            m["calls_s"] = {k: [round(x, 4) for x in v] for k, v in calls.items()}
            print(f"server sync {i}: {m}", flush=True)
            if i:
                syncs.append(m)
        client.close()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    return {"syncs": syncs, "gb_per_s": h.median([m["sync/bytes_per_s"] for m in syncs]) / 1e9,
            "seconds": h.median([m["sync/seconds"] for m in syncs]), "bytes": syncs[-1]["sync/bytes"],
            "probe_max": max(m["rollout/logprob_max_abs_diff"] for m in syncs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main", choices=("main", "sender", "receiver"))
    ap.add_argument("--bucket_mb", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server_syncs", type=int, default=3, help="syncs into a kit server in namespace B; 0: skip")
    args = ap.parse_args()
    if args.role == "receiver":
        return receiver()
    if args.role == "sender":
        out = {"wire": sender(args)}
        if args.server_syncs:
            out["server"] = server_sync(args, h.build_model())
        print("RESULT " + json.dumps(out), flush=True)
        return
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("sync_stream: skipped (needs root and iproute2 for two network namespaces)")
        return
    h.build_model()  # built here, outside the namespaces
    h.RESULTS.mkdir(parents=True, exist_ok=True)
    netns_up()
    try:
        p = subprocess.run(in_ns(NS_A, ["--role", "sender", "--bucket_mb", str(args.bucket_mb), "--rounds",
                                        str(args.rounds), "--server_syncs", str(args.server_syncs)]),
                           capture_output=True, text=True, timeout=1800,
                           env={**h.bench_env(), "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        netns_down()
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode:
        sys.exit(f"sync_stream: the sender failed (exit {p.returncode})")
    print(p.stdout[-4000:])
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    print(f"results: {h.save_results('sync_stream_vs_base64', out)}")
    wire = out["wire"]["gb_per_s"]
    server = out.get("server")
    print(h.summary_line("sync_stream", wire["stream"] / wire["base64"],
                         f"across two network namespaces (veth), {args.bucket_mb:g} MiB buckets: stream "
                         f"{wire['stream']:.2f} GB/s ({wire['stream_tls']:.2f} over TLS), base64 "
                         f"{wire['base64']:.3f} GB/s" + (
                             f"; a sync into a kit vLLM server across them (TLS): {server['gb_per_s']:.2f} GB/s "
                             f"({server['bytes'] / 1e6:.0f} MB in {server['seconds']:.2f} s, probe "
                             f"{server['probe_max']:.1e})" if server else "")))


if __name__ == "__main__":
    main()
