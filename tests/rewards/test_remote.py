"""Rewards over HTTP (verl_kit.rewards.remote): the reward server (`python -m verl_kit.rewards.serve`) and its client,
RemoteRewardModel (--reward_model_url), against a real server started as a user starts it; the LLM judge's rubric and
score parsing by hand, and the judge against the shared vLLM server. A PPO run driven by a served reward model:
tests/recipes/test_reward_model_runs.py::test_sft_then_reward_model_then_ppo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests
import torch
from helpers import REPO, build_reward_model, env, reward_server

from verl_kit.errors import UserError
from verl_kit.rewards import (
    CallLimits,
    LLMJudge,
    RemoteRewardModel,
    Rewards,
    call_reward_fn,
    load_reward_model,
    parse_score,
)

PROMPTS = [[{"role": "user", "content": "Describe the sea."}], "plain prompt: ", "mid: ", "a third "]
COMPLETIONS = ["The sea is calm and kind.", "zebra", "a calm reply", "quartz jukebox " * 40]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rm = build_reward_model(str(tmp_path_factory.mktemp("rm")))
    with reward_server(rm, tmp_path_factory.mktemp("cache"), "--batch_size", "2", "--max_length", "64") as served:
        yield rm, *served


def test_served_scores_equal_the_local_reward_model(served):
    """The served model renders (its chat template), tokenizes (its own tokenizer, truncated at --max_length) and
    batches (--batch_size, by sorted length) as a run's local reward model does: the scores are equal bit for bit, in
    the order of the samples. /info names the model."""
    rm, url, key, _ = served
    remote = RemoteRewardModel(url, key=key)
    local = load_reward_model(rm, lambda load: load().eval(), "cpu", max_length=64, batch_size=2)
    assert remote.name == os.path.basename(rm), remote.name
    assert remote.max_length == 64
    got, want = remote.score(PROMPTS, COMPLETIONS), local.score(PROMPTS, COMPLETIONS)
    assert got.dtype == torch.float32 and torch.equal(got, want), (got, want)


def test_the_key_is_required_on_every_route_and_bad_bodies_are_400(served):
    """No key or a wrong one: 401 on every route; the client stops in one line naming the flag and the variable. A
    body the server does not serve (counts that differ, an unknown field, a completion that is not text) is a 400
    naming the field."""
    _, url, key, _ = served
    for method, path in (("GET", "/info"), ("GET", "/health"), ("POST", "/score"), ("GET", "/docs")):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            assert requests.request(method, url + path, headers=headers, timeout=10).status_code == 401, path
    with pytest.raises(UserError, match="--reward_model_url .* refused the key .*VERL_KIT_REWARD_KEY"):
        RemoteRewardModel(url, key="nope")
    auth = {"Authorization": f"Bearer {key}"}
    for body, field in (({"prompts": ["a"], "completions": ["b", "c"]}, "1 prompts for 2 completions"),
                        ({"prompts": ["a"], "completions": ["b"], "n": 2}, "n: Extra inputs"),
                        ({"prompts": ["a"], "completions": [3]}, "completions.0")):
        r = requests.post(url + "/score", json=body, headers=auth, timeout=10)
        assert r.status_code == 400 and field in r.json()["error"], (body, r.text)


def test_a_lost_server_is_the_fallback_or_one_line(tmp_path):
    """A served reward model that goes away mid-run: with --reward_fallback every sample of the batch scores it,
    counted in reward/errors; without, the run stops in one line naming the server. (Retries are 0 here; a run
    retries a refused connection 3 times, 1, 2 and 4 s apart.) Beyond loopback the server refuses to start without
    TLS, in one line."""
    rm = build_reward_model(str(tmp_path / "rm"))
    with reward_server(rm, tmp_path / "cache") as (url, key, _):
        remote = RemoteRewardModel(url, key=key, retries=0)
    for fallback in (-1.0, None):
        limits = CallLimits(fallback=fallback)
        rewards = Rewards(None, remote, None, limits=limits)
        if fallback is None:
            with pytest.raises(UserError, match=f"reward model at {url}: unreachable after 1 tries.*--reward_fallback"):
                rewards.sources(PROMPTS, COMPLETIONS)
        else:
            (scores,) = rewards.sources(PROMPTS, COMPLETIONS).values()
            assert scores.tolist() == [-1.0] * 4 and (limits.errors, limits.timeouts) == (4, 0)
    p = subprocess.run([sys.executable, "-m", "verl_kit.rewards.serve", "--model", rm, "--host", "0.0.0.0"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
        "error: --host 0.0.0.0: beyond loopback the server's key would cross the network in clear"), p.stderr[-2000:]
    assert "--reward_model_ca_file" in p.stderr


# ---- the judge ------------------------------------------------------------------------------------------------------

def test_judge_scores_and_rubric():
    """parse_score reads the last "Score: N" (any case, `=` or `:`, markdown bold) or a bare number, over max_score;
    no score, or one out of range, raises (a failed call: --reward_fallback or one line). The rubric is filled from
    the prompt (chat messages as `role: content` lines), the completion, max_score and the row's columns; a field
    that is none of them is one line naming it. structured_output asks vLLM for exactly "Score: N" with N in
    0..max_score (10 before 1, so "10" is reachable)."""
    assert parse_score("Score: 7", 10) == 0.7
    assert parse_score("I think... score = 3. Final **Score:** 10", 10) == 1.0
    assert parse_score(" 4 \n", 5) == 0.8
    assert parse_score("SCORE: 2.5", 10) == 0.25
    for bad in ("great reply", "Score: 11", "Score: -1", ""):
        with pytest.raises(ValueError):
            parse_score(bad, 10)
    judge = LLMJudge("http://127.0.0.1:1/v1", "m", rubric="Q: {prompt}\nA: {completion}\nRef: {answer} /{max_score}",
                     max_score=3, structured_output=True)
    body = judge.body([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}], "Hello!",
                      {"answer": "Hello"})
    assert body["messages"] == [{"role": "user", "content": "Q: system: Be kind.\nuser: Hi\nA: Hello!\nRef: Hello /3"}]
    assert body["structured_outputs"] == {"regex": "Score: (3|2|1|0)"} and body["temperature"] == 0.0
    with pytest.raises(UserError, match="LLMJudge rubric: field 'answer' is neither"):
        LLMJudge("http://x/v1", "m", rubric="{answer}").body("p", "c", {})
    assert judge.__name__ == "llm_judge"


@pytest.mark.slow
def test_judge_against_a_vllm_server(vllm_server):
    """LLMJudge on the shared vLLM server (the tiny random model, over https with its key and certificate), through
    the run's async reward path: with structured_output every reply is a grade (vLLM's regex-constrained decoding),
    greedy so the same grades twice; without it the random model's replies hold no score, and each sample is scored
    --reward_fallback, counted in reward/errors. A wrong key is one line."""
    url = vllm_server.url + "/v1"
    model = requests.get(url + "/models", headers={"Authorization": f"Bearer {vllm_server.api_key}"},
                         verify=vllm_server.ca_file, timeout=30).json()["data"][0]["id"]
    prompts, completions = ["Say something kind. ", "Count to three. "], ["You are wonderful.", "one two three"]
    judge = LLMJudge(url, model, api_key=vllm_server.api_key, ca_file=vllm_server.ca_file, structured_output=True,
                     max_tokens=8)
    limits = CallLimits(timeout_s=120, fallback=-1.0, max_concurrency=2)
    first = call_reward_fn("judge", judge, prompts, completions, {}, None, limits).tolist()
    again = call_reward_fn("judge", judge, prompts, completions, {}, None, limits).tolist()
    assert first == again and all(0 <= s <= 1 and abs(s * 10 - round(s * 10)) < 1e-5 for s in first), first
    assert (limits.errors, limits.timeouts) == (0, 0)
    free = LLMJudge(url, model, api_key=vllm_server.api_key, ca_file=vllm_server.ca_file, max_tokens=8)
    assert call_reward_fn("judge", free, prompts, completions, {}, None, limits).tolist() == [-1.0, -1.0]
    assert limits.errors == 2
    wrong = LLMJudge(url, model, api_key="nope", ca_file=vllm_server.ca_file)
    with pytest.raises(UserError, match="LLMJudge .* refused the key"):
        call_reward_fn("judge", wrong, prompts, completions, {}, None, limits)
