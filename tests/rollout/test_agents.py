"""`--agent` (verl_kit.rollout.agents, rollout.endpoint): an agent written against the OpenAI SDK, served by the run's
rollout backend through the loopback endpoint. What the trainer trains on equals, id for id, what the endpoint served:
the merged shape (a call that extends the previous one token for token: one sequence, the inserted tokens masked)
and the per-call shape (a call that rewrote the history: a new sample of the same episode), on HF generate here, on
colocated vLLM in tests/rollout/test_vllm.py's driver and on the vLLM server in the slow tier. Keyless and unknown
keys are refused; a raising, hanging (plain and async) and malformed agent each end as a counted failure; the
calculator example agent offers the environment's own tool schema; recipes/grpo.py and ppo.py train on agents."""

import asyncio
import json
import time
import types
import urllib.error
import urllib.request

import pytest
import torch
from helpers import eos_biased_engine, metrics, recipe_cmd, run
from test_episodes import Recording

from verl_kit.rollout import AgentEpisodes, SamplingParams

ROW = {"prompt": [{"role": "user", "content": "Add two and three. Be brief."}], "answer": "5"}


def split_of(rows, tokenizer):
    """A rollout.prompts.Prompts stand-in: the rows and their prompts' ids."""
    return types.SimpleNamespace(rows=rows, ids=[tokenizer.apply_chat_template(
        r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False) for r in rows])


def scripted(log: dict):
    """A plain agent on the OpenAI SDK: asks, sends the reply back with a user turn (the merged shape), and with the
    row's `rewrite` column asks once more from a rewritten history (the per-call shape). Every completion it got,
    with the ids and log-probs the endpoint served, is kept in log[its key]."""
    def agent(client, row):
        mine = log.setdefault(client.api_key, [])

        def ask(messages):
            reply = client.chat.completions.create(model="any", messages=messages, logprobs=True,
                                                   extra_body={"return_token_ids": True}).model_dump()
            mine.append(reply)
            return {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}

        messages = list(row["prompt"])
        messages += [ask(messages), {"role": "user", "content": "again 1"}]
        last = ask(messages)
        if row.get("rewrite"):
            ask([{"role": "user", "content": "In short: " + (last.get("content") or "")}])
        return 1.0
    return agent


def served_episodes(log: dict) -> tuple[list, int, int]:
    """The training rows the calls in `log` must give, per episode: a call whose prompt ids extend the previous
    call's prompt and completion (not cut by length) continues its row (the ids in between inserted), else it starts
    a new row. Returns (episodes as lists of (prompt, ids, sampled, logprobs) rows, merged calls, split calls)."""
    episodes, merged, split = [], 0, 0
    for calls in log.values():
        rows, cut = [], True
        for reply in calls:
            prompt, choice = reply["prompt_token_ids"], reply["choices"][0]
            ids = choice["token_ids"]
            lps = [t["logprob"] for t in choice["logprobs"]["content"]]
            whole = rows[-1][0] + rows[-1][1] if rows else None
            if rows and not cut and len(prompt) > len(whole) and prompt[:len(whole)] == whole:
                env = prompt[len(whole):]
                rows[-1] = (rows[-1][0], whole[len(rows[-1][0]):] + env + ids, rows[-1][2] + [False] * len(env)
                            + [True] * len(ids), rows[-1][3] + [0.0] * len(env) + lps)
                merged += 1
            else:
                split += bool(rows)
                rows.append((prompt, ids, [True] * len(ids), lps))
            cut = choice["finish_reason"] == "length"
        episodes.append(rows)
    return episodes, merged, split


def trained_episodes(ro) -> list:
    """The rollout's rows, grouped by episode, as (prompt, ids, sampled, logprobs)."""
    out = {}
    for i, e in enumerate(ro.row_episode().tolist()):
        m = ro.sequence_mask[i]
        out.setdefault(e, []).append((ro.prompt_ids[i], ro.response_ids[i][m].tolist(),
                                      ro.response_mask[i][m].tolist(), ro.sampling_logprobs[i][m].tolist()))
    return list(out.values())


def agent_episodes(engine, tokenizer, seed: int | None = None) -> dict:
    """4 episodes of the scripted agent on `engine` (two rewrite their history): the trained rows must equal the
    served ones. Returns the counts of merged and split calls (the caller checks there were some)."""
    log: dict = {}
    rec = Recording(engine)
    eps = AgentEpisodes(rec, tokenizer, "tiny-llama", scripted(log), max_prompt_length=64, max_completion_length=48)
    try:
        rows = [ROW, ROW, {**ROW, "rewrite": True}, {**ROW, "rewrite": True}]
        ro = eps.generate(split_of(rows, tokenizer), [0, 1, 2, 3], SamplingParams(max_new_tokens=48, seed=seed))
    finally:
        eps.close()
    expected, merged, split = served_episodes(log)
    trained = trained_episodes(ro)
    assert sorted(map(str, trained)) == sorted(map(str, expected))  # id for id, log-prob for log-prob
    fed = [p for prompts, _ in rec.calls for p in prompts]  # the engine was given exactly the served prompts
    assert sorted(map(str, fed)) == sorted(str(r["prompt_token_ids"]) for calls in log.values() for r in calls)
    assert ro.env_reward.tolist() == [1.0] * len(ro.prompt_ids)
    return {"merged": merged, "split": split, "rows": len(ro.prompt_ids), "calls": sum(map(len, log.values()))}


@pytest.fixture(scope="module")
def eos_engine(tiny_model_path, tokenizer):
    """HF generate on the tiny model, its EOS logit raised so that turns end."""
    return eos_biased_engine(tiny_model_path, tokenizer)


def test_agent_tokens_exact_hf_generate(eos_engine, tokenizer):
    torch.manual_seed(0)
    out = agent_episodes(eos_engine, tokenizer)
    print(out)
    assert out["merged"] >= 2 and out["split"] >= 2, out
    assert out["rows"] == 4 + out["split"]


async def one_call(client, row):
    reply = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2)
    return float(reply.usage.completion_tokens)


def test_many_concurrent_episodes_share_one_generate(eos_engine, tokenizer):
    """512 async episodes connect at once to the one endpoint (more than a default listen backlog holds): none is
    lost or refused, every one is answered, in batches of many rows (the episodes waiting together share a generate
    call), with the request's max_tokens bounding its reply."""
    rec = Recording(eos_engine)
    eps = AgentEpisodes(rec, tokenizer, "tiny-llama", one_call, max_concurrency=512, max_prompt_length=64,
                        max_completion_length=8)
    try:
        ro = eps.generate(split_of([ROW], tokenizer), [0], SamplingParams(max_new_tokens=8, n=512))
    finally:
        eps.close()
    assert [e["reward_error"] for e in ro.episodes] == [None] * 512
    assert ro.response_mask.sum(-1).tolist() == ro.env_reward.long().tolist() and ro.env_reward.max() <= 2
    assert max(len(prompts) for prompts, _ in rec.calls) >= 32, [len(p) for p, _ in rec.calls]


def probe_agent(client, row):
    """Behaves as its row's `kind` says: the endpoint's key checks, a good episode, and each way of failing."""
    kind = row["kind"]
    if kind == "keys":  # the endpoint refuses what has no valid key; lists the model for a valid one
        statuses = []
        for key in (None, "vk-not-a-key"):
            request = urllib.request.Request(str(client.base_url) + "models",
                                             headers={"Authorization": f"Bearer {key}"} if key else {})
            try:
                urllib.request.urlopen(request, timeout=10)
                statuses.append(200)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
        models = [m.id for m in client.models.list().data]
        return float(statuses == [401, 401] and models == ["tiny-llama"])
    if kind == "raises":
        client.chat.completions.create(model="any", messages=row["prompt"])
        raise RuntimeError("the agent's own bug")
    if kind == "hangs":
        time.sleep(30)
    if kind == "malformed":
        return "yes"
    if kind == "bad_request":  # a 400 from the endpoint: the SDK raises it, the agent does not catch it
        client.chat.completions.create(model="any", messages=[{"content": "no role"}])
    return None  # --reward_fn scores it


async def async_hang(client, row):
    await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)
    await asyncio.sleep(30)


def test_failing_agents_are_counted_and_keys_checked(eos_engine, tokenizer):
    """A raising, hanging, malformed and 400-provoking agent each end their episode as a failure (reward NaN for
    Rewards to score --reward_fallback, episode/env_errors, the reason kept), within --agent_timeout_s; the others
    score; an async agent that hangs is cut the same way; the endpoint refused the keyless and the unknown key."""
    kinds = ["keys", "raises", "hangs", "malformed", "bad_request", "none"]
    rows = [{**ROW, "kind": k} for k in kinds]
    eps = AgentEpisodes(eos_engine, tokenizer, "tiny-llama", probe_agent, timeout_s=2.0, max_prompt_length=64,
                        max_completion_length=8)
    t0 = time.time()
    try:
        ro = eps.generate(split_of(rows, tokenizer), list(range(len(rows))), SamplingParams(max_new_tokens=8))
    finally:
        eps.close()
    assert time.time() - t0 < 20
    errors = {k: e["reward_error"] for k, e in zip(kinds, ro.episodes)}
    print(errors)
    assert ro.env_reward[0] == 1.0 and ro.env_reward[-1] == 0.0  # keys checked; None: no agent score
    assert all(e is None for k, e in errors.items() if k in ("keys", "none"))
    assert "RuntimeError: the agent's own bug" in errors["raises"] and "timed out" in errors["hangs"]
    assert "not a finite number" in errors["malformed"] and "BadRequestError" in errors["bad_request"]
    assert [e["env_errors"] for e in ro.episodes] == [0, 1, 1, 1, 1, 0]
    assert torch.isnan(ro.env_reward[1:5]).all()
    assert len(ro.prompt_ids) == 6 and ro.response_mask[0].sum() == 0  # no call: an empty row

    eps = AgentEpisodes(eos_engine, tokenizer, "tiny-llama", async_hang, timeout_s=2.0, max_prompt_length=64,
                        max_completion_length=8)
    try:
        ro = eps.generate(split_of([ROW], tokenizer), [0], SamplingParams(max_new_tokens=8))
    finally:
        eps.close()
    assert "timed out" in ro.episodes[0]["reward_error"] and ro.response_mask[0].sum() > 0  # its call was kept


def test_calculator_agent_offers_the_environments_tool():
    """examples/agents.py's schema is the one transformers derives from the environment's method: the policy sees
    the same system prompt under --agent as under --environment_factory."""
    from transformers.utils import get_json_schema

    from verl_kit.config import load_object

    environment = load_object("environment_factory", "examples/environments.py:Calculator")
    agents = __import__("importlib").util.spec_from_file_location("agents_example", "examples/agents.py")
    module = __import__("importlib").util.module_from_spec(agents)
    agents.loader.exec_module(module)
    assert json.dumps(module.CALCULATE) == json.dumps(get_json_schema(environment.calculate))  # key order too


AGENT_FILE = '''
import itertools

STARTED = itertools.count()


async def agent(client, row):
    """Step 1: episode 0 fails after its call; odd episodes call again from a rewritten history (a second sample).
    Step 2: every episode fails before any call."""
    n = next(STARTED)  # before any await: the episodes' order
    if n >= 4:
        raise RuntimeError("down")
    first = await client.chat.completions.create(model="policy", messages=row["prompt"])
    if n == 0:
        raise ValueError("no")
    if n % 2:
        text = first.choices[0].message.content or ""
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Sum up: " + text}])
    return None
'''


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_agent_runs_through_the_online_recipes(recipe, tmp_path):
    """An async agent through recipes/grpo.py and ppo.py on the tiny model, HF generate: step 1 ends with the
    agent's episodes scored by --reward_fn (it returns None), the per-call samples of two episodes trained
    (episode/samples 6 / 4) and the failed one counted (episode/env_errors 1 / 4); step 2, where every episode
    fails (no token to learn from), is counted and the run goes on."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_FILE)
    out = tmp_path / "run"
    p = run(recipe_cmd(f"{recipe}.py", ["--config", f"recipes/configs/{recipe}_tiny.yaml", "--output_dir", str(out),
                                        "--max_steps", "2", "--prompts_per_step", "2", "--num_generations", "2",
                                        "--max_completion_length", "8", "--dataset_test_split", "none",
                                        "--logging_steps", "1", "--agent", f"{agent}:agent"]), timeout=300)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert len(rows) == 2, rows
    assert rows[0]["episode/samples"] == 1.5 and rows[0]["episode/env_errors"] == 0.25, rows[0]
    assert rows[1]["episode/env_errors"] == 1 and rows[1]["response_length/mean"] == 0, rows[1]
    assert p.stderr.count("all 4 episodes of this batch failed") == 1, p.stderr[-3000:]  # step 2's, said
    print({k: v for k, v in rows[0].items() if k.startswith(("episode", "reward"))})
