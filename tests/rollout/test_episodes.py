"""Multi-turn episodes (verl_kit.rollout.episodes): the prefix-property refusal, tool calls parsed, failed and timed out
(counted, the episode goes on), `reset` raising in one line, a prompt too long with its tools, the trained token
sequence equal to the engine's sampled ids plus the environment's (HF generate here, the vLLM server in the slow
tier, colocated vLLM in tests/rollout/test_vllm.py's driver), and a TRL-style environment class running unchanged
through recipes/grpo.py."""

import contextlib
import copy
import json
import time
from dataclasses import replace

import pytest
import torch
from helpers import (
    Scripted,
    add,
    assert_adapter_export,
    eos_biased_engine,
    launch_cmd,
    metrics,
    numbers,
    recipe_cmd,
    run,
)

from verl_kit.errors import UserError
from verl_kit.rollout import SamplingParams
from verl_kit.rollout.chat import check_prefix_property
from verl_kit.rollout.episodes import Episodes
from verl_kit.rollout.prompts import episode_metrics
from verl_kit.train.actor_critic import pack_responses

ROW = {"prompt": [{"role": "user", "content": "Add two and three."}], "answer": "5"}


def boom() -> str:
    """A tool that always raises."""
    raise RuntimeError("kaput")


def hang() -> str:
    """A tool that hangs."""
    time.sleep(3)
    return "late"


def test_prefix_property_refusal(tokenizer):
    """The tiny template appends turn by turn and passes; one that writes the number of messages first rewrites the
    text before every new turn and is refused at turn 2, naming the model."""
    check_prefix_property(tokenizer, "tiny-llama", native_tools=False)
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = ("{{ messages|length }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(UserError, match=r"^my-model: the chat template does not extend .* turn 2 \(assistant\)"):
        check_prefix_property(broken, "my-model", native_tools=False)


def test_tool_calls_failures_and_timeout_are_counted(tokenizer):
    """Turn 1 makes 5 calls: add (ok), malformed JSON, an unknown tool, a raising tool and a hanging one (cut at
    0.3 s). The model sees each result (TRL's {'error': ...} for the 4 failures), and the episode goes on to turn 2,
    which calls nothing and ends it. call_frequency = 5 calls / 1 episode, failure_frequency = 4 / 5."""
    turn1 = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
             '<tool_call>{"name": add</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    engine = Scripted(tokenizer, [turn1, "5"])
    eps = Episodes(engine, tokenizer, "tiny-llama", tools=[add, boom, hang], tool_timeout_s=0.3,
                   max_prompt_length=1024, max_completion_length=1500)
    t0 = time.time()
    ro = eps.run([ROW], [1], SamplingParams())
    assert time.time() - t0 < 2.5  # the hanging tool was not waited for
    ep = ro.episodes[0]
    assert (ep["turns"], ep["tool_calls"], ep["tool_failures"]) == (2, 5, 4)
    results = [m["content"] for m in ep["messages"] if m["content"].startswith("<tool_response>")]  # fallback: user
    assert "\n5\n" in results[0] and "not JSON" in results[1] and "Tool nope not found" in results[2]
    assert "kaput" in results[3] and "timed out after 0.3 s" in results[4]
    assert "<tools>" in tokenizer.decode(ro.prompt_ids[0]) and '"name": "add"' in tokenizer.decode(ro.prompt_ids[0])
    m = episode_metrics(ro, ro.env_reward)
    assert m["tools/call_frequency"] == 5 and m["tools/failure_frequency"] == 0.8 and m["episode/turns"] == 2
    # the second call continued from the prompt + turn 1's tokens + the tool results' tokens, as ids
    n1, k = len(tokenizer(turn1, add_special_tokens=False)["input_ids"]) + 1, len(engine.prompts[1][0])
    assert engine.prompts[1][0] == ro.prompt_ids[0] + ro.response_ids[0][:k - len(ro.prompt_ids[0])].tolist()
    assert ro.response_mask[0, :n1].all() and ro.env_mask[0, n1:k - len(ro.prompt_ids[0])].all()


def test_calculator_example_environment(tokenizer):
    """examples/environments.py:Calculator as --environment_factory loads it: the model's call to `calculate` gets
    924 * 607 = 560868 back, its final reply is checked against the row's answer by get_reward (1, then 0 for a
    wrong reply), and a reward of the environment alone is allowed (--reward_fn none). Its warm-start trace for the
    SFT recipe (examples/environments.py traces) renders to the episode's token ids exactly."""
    from verl_kit.config import load_object
    from verl_kit.rewards import Rewards

    env = load_object("environment_factory", "examples/environments.py:Calculator")
    row = {"prompt": [{"role": "user", "content": "What is 924 * 607?"}], "answer": "560868"}
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "924 * 607"}}</tool_call>'
    for final, reward in (("560868", 1.0), ("560000", 0.0)):
        ro = Episodes(Scripted(tokenizer, [call, final]), tokenizer, "tiny-llama", env_factory=env,
                      max_prompt_length=1024, max_completion_length=400).run([row], [1], SamplingParams())
        assert ro.episodes[0]["messages"][-2]["content"] == "<tool_response>\n560868\n</tool_response>"
        assert ro.env_reward.tolist() == [reward] and ro.episodes[0]["tool_calls"] == 1
        scored = Rewards("none", None, None, tokenizer=tokenizer, env_reward=True).of_rollout(replace(ro, rows=[row]))
        assert scored.total.tolist() == [reward]
        if reward:  # the warm-start trace of this row (SFT messages) renders to exactly this episode's tokens
            traces = load_object("traces", "examples/environments.py:calculator_traces")
            messages = traces([row], "tiny-llama")[0]["messages"]
            assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
            rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            assert rendered == ro.prompt_ids[0] + ro.response_ids[0][ro.sequence_mask[0]].tolist()


def test_qwen3_template_episode_is_token_exact(tiny_model_path, tmp_path):
    """A Calculator episode on a tokenizer with Qwen3's template (refused for episodes as it is), loaded as a
    multi-turn run loads it (TRL's qwen3 training template, --chat_template_kwargs enable_thinking false): the model's
    <tool_call> is parsed and answered, the second turn continues from the first turn's and the tool result's ids,
    and the whole episode is, id for id, the template's rendering of its conversation (less the newline the template
    puts after the final <|im_end|>, where the episode stops)."""
    from helpers import qwen3_tokenizer
    from transformers.utils import get_json_schema

    from verl_kit.config import load_object
    from verl_kit.models import load_tokenizer

    tok = load_tokenizer(qwen3_tokenizer(tiny_model_path, tmp_path / "qwen3"), {"enable_thinking": False},
                         multi_turn=True)
    env = load_object("environment_factory", "examples/environments.py:Calculator")
    row = {"prompt": [{"role": "user", "content": "What is 924 * 607?"}], "answer": "560868"}
    engine = Scripted(tok, ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "924 * 607"}}\n'
                            "</tool_call>", "560868"])
    ro = Episodes(engine, tok, "qwen3-tiny", env_factory=env, max_prompt_length=1024,
                  max_completion_length=400).run([row], [1], SamplingParams())
    ep = ro.episodes[0]
    assert (ep["turns"], ep["tool_calls"], ep["tool_failures"], ro.env_reward.tolist()) == (2, 1, 0, [1.0])
    assert [m["role"] for m in ep["messages"]] == ["user", "assistant", "tool", "assistant"]
    k = len(engine.prompts[1][0])
    assert engine.prompts[1][0] == ro.prompt_ids[0] + ro.response_ids[0][:k - len(ro.prompt_ids[0])].tolist()
    episode = ro.prompt_ids[0] + ro.response_ids[0][ro.sequence_mask[0]].tolist()
    rendered = tok.apply_chat_template(ep["messages"], tools=[get_json_schema(env().calculate)], tokenize=True,
                                       return_dict=False)
    assert rendered[:len(episode)] == episode and tok.decode(rendered[len(episode):]) == "\n"
    assert "<think>\n\n</think>\n\n560868<|im_end|>" in tok.decode(episode)


class Raising:
    def reset(self, **row):
        raise KeyError("level")


def test_reset_raising_and_long_prompt_are_one_line(tokenizer):
    eps = Episodes(Scripted(tokenizer, []), tokenizer, "tiny-llama", env_factory=Raising, max_prompt_length=64)
    with pytest.raises(UserError, match=r"^Raising\.reset failed on dataset row 7: KeyError: 'level'$"):
        eps.run([ROW], [7], SamplingParams())
    eps = Episodes(Scripted(tokenizer, []), tokenizer, "tiny-llama", tools=[add], max_prompt_length=40)
    with pytest.raises(UserError, match=r"^dataset row 3: the prompt with its tool descriptions is \d+ tokens, "
                                        r"over --max_prompt_length 40"):
        eps.run([ROW], [3], SamplingParams())


class Strict:
    """An environment whose reset takes exactly the row's columns: the `environment` column must not reach it."""

    def reset(self, prompt, answer):
        self.answer = answer

    def get_reward(self) -> float:
        return 2.0


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=[pytest.mark.slow, pytest.mark.real_model])])
def test_multi_environment_rows_choose_their_environment(model, request):
    """TRL's dict of factories, as the flag name=spec,...: each row's `environment` column picks its environment,
    whose tools alone its prompt shows (the calculator's on row 1, none on the feedback row 2), `environment` is not
    passed to reset, and each episode gets its own environment's reward (get_reward: 1 for 560868; KindFeedback
    after two follow-ups: 1/4 - 0.2; Strict: 2), logged per environment (env/<name>/*, eval/env/<name>/reward_mean).
    An unknown or missing name, and a half-named flag, are one line.
    On the tiny and the real model's template (SmolLM2: no tool support, the tools in the system message)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from verl_kit.config import EnvironmentConfig
    from verl_kit.models.loading import load_tokenizer
    from verl_kit.rollout import Scores
    from verl_kit.rollout.episodes import make_episodes
    from verl_kit.rollout.prompts import Prompts, episode_metrics, evaluate

    tok = request.getfixturevalue("tokenizer") if model == "tiny" else load_tokenizer(request.getfixturevalue(
        "smollm2_path"))
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "924 * 607"}}</tool_call>'
    cfg = EnvironmentConfig(environment_factory="calc=examples/environments.py:Calculator, "
                                                "kind=examples/environments.py:KindFeedback", tool_timeout_s=5.0)
    eps = make_episodes(cfg, Scripted(tok, [call, "560868", "lovely"]), tok, model, 1024, 400)
    eps.env_factories["strict"] = Strict
    q = [{"role": "user", "content": "What is 924 * 607?"}]
    rows = [{"prompt": q, "answer": "560868", "environment": e} for e in ("calc", "kind", "strict")]
    ro = eps.run(rows, [1, 2, 3], SamplingParams())
    prompts = [tok.decode(p) for p in ro.prompt_ids]
    assert '"name": "calculate"' in prompts[0] and "calculate" not in prompts[1] + prompts[2]
    assert [e["turns"] for e in ro.episodes] == [2, 3, 1] and [e["tool_calls"] for e in ro.episodes] == [1, 0, 0]
    assert ro.episodes[0]["messages"][-2]["content"] == "<tool_response>\n560868\n</tool_response>"
    assert ro.env_reward.tolist() == pytest.approx([1.0, 0.25 - 0.2, 2.0])
    # each environment's own metrics, in training (the total rewards given) and held out (the same script again)
    third, share = 1 / 3, float(ro.env_mask.sum() / ro.sequence_mask.sum())
    assert episode_metrics(ro, torch.tensor([1.0, 0.05, 2.0]), eps.environments) == pytest.approx({
        "tools/call_frequency": third, "tools/failure_frequency": 0.0, "episode/turns": 2.0,
        "episode/env_token_share": share, "episode/env_errors": 0.0, "episode/samples": 1.0,
        **{f"env/{name}/{k}": v for name, values in (("calc", (1.0, 1.0, 2.0)), ("kind", (0.05, 0.0, 3.0)),
                                                       ("strict", (2.0, 0.0, 1.0)))
           for k, v in zip(("reward_mean", "tool_call_frequency", "turns"), values)},
        **{f"env/{name}/{k}": v for name in ("calc", "kind", "strict")
           for k, v in (("share", third), ("tool_failure_frequency", 0.0))}})
    eps.engine.texts += [call, "560868", "lovely"]
    split = Prompts(rows, [[0]] * 3)
    held_out = evaluate(SimpleNamespace(num_processes=1, process_index=0, is_main_process=False),
                        lambda idx, params: eps.generate(split, idx, params, "the held-out split"), split,
                        SamplingParams(), lambda ro: Scores(ro.env_reward), 3, environments=eps.environments)
    assert {k: v for k, v in held_out.items() if k.startswith("eval/env/")} == pytest.approx({
        "eval/env/calc/reward_mean": 1.0, "eval/env/kind/reward_mean": 0.05, "eval/env/strict/reward_mean": 2.0})
    for bad, shown in (({**rows[0], "environment": "chess"}, "'chess'"), (dict(ROW), "None")):
        with pytest.raises(UserError, match=rf"^dataset row 4: field 'environment' is {shown}, not one of "
                                            r"\['calc', 'kind', 'strict'\] \(--environment_factory\)$"):
            eps.run([bad], [4], SamplingParams())
    with pytest.raises(UserError, match=r"^--environment_factory .*: name every environment once"):
        make_episodes(replace(cfg, environment_factory="a=x.py:A,x.py:B"), None, tok, model, 1024, 400)


class Again:
    """Answers every assistant turn twice, then ends the episode."""

    def reset(self, **row):
        self.n = 0
        return " Be brief."

    def respond(self, text):
        self.n += 1
        return None if self.n > 2 else f"again {self.n}"


class Recording:
    """The real HF-generate backend, its every call and result kept."""

    def __init__(self, engine):
        self.engine, self.per_sample_seeds, self.calls = engine, engine.per_sample_seeds, []

    def generate(self, prompts, params):
        ro = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], ro))
        return ro

    def __getattr__(self, name):  # the rest of the engine (HF generate's keep_prefixes) as it is
        return getattr(self.engine, name)


class Whole:
    """The HF-generate backend with keep_prefixes a no-op: every turn prefills the whole episode."""

    per_sample_seeds = False

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def keep_prefixes(self):
        return contextlib.nullcontext()


def episode_is_token_exact(ro, calls, pad) -> int:
    """Replays the engine's calls: each call's prompt for an episode is exactly its prompt + its ids so far; the
    sampled ids (and log-probs) of each turn come next in the trained sequence, then the environment's ids up to the
    next call's prompt. The trained sequence (as the packer lays it out for the forward) must equal that byte for
    byte, environment tokens outside the loss mask with sampling log-prob 0, the scored tokens the sampled ones.
    Returns the number of turns that were followed by another."""
    B = len(ro.prompt_ids)
    final = [ro.response_ids[i][ro.sequence_mask[i]].tolist() for i in range(B)]
    so_far, flags, lps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    active, continued = list(range(B)), 0
    for c, (prompts, out) in enumerate(calls):
        assert len(prompts) == len(active)
        nxt = []
        for k, i in enumerate(active):
            assert prompts[k] == ro.prompt_ids[i] + so_far[i]  # generation continued from the ids, not from text
            keep = len(final[i]) - len(so_far[i])
            ids = out.response_ids[k][out.response_mask[k]].tolist()[:keep]
            so_far[i] += ids
            flags[i] += [True] * len(ids)
            lps[i] += out.sampling_logprobs[k][out.response_mask[k]].tolist()[:keep]
            if len(final[i]) > len(so_far[i]):
                nxt.append(i)
        for k, i in enumerate(nxt):  # the environment's tokens: what the next call added after the sampled ids
            env = calls[c + 1][0][k][len(ro.prompt_ids[i]) + len(so_far[i]):]
            so_far[i] += env
            flags[i] += [False] * len(env)
            lps[i] += [0.0] * len(env)
            continued += 1
        active = nxt
    assert not active
    batch, index = pack_responses(ro.prompt_ids, ro.response_ids, ro.response_mask, list(range(B)), pad,
                                  packing=False, packing_length=4096, block_mask=False, env_mask=ro.env_mask)
    for i in range(B):
        n = len(final[i])
        assert final[i] == so_far[i], i
        trained = batch.input_ids[i][batch.seq_ids[i] >= 0].tolist()
        assert trained == ro.prompt_ids[i] + so_far[i]
        assert ro.response_mask[i, :n].tolist() == flags[i] and ro.env_mask[i, :n].tolist() == [not f for f in flags[i]]
        assert ro.sampling_logprobs[i, :n].tolist() == lps[i]
        assert index.targets[index.row == i].tolist() == ro.response_ids[i][ro.response_mask[i]].tolist()
    return continued


def test_episode_tokens_exact_hf_generate(tiny_model_path, tokenizer):
    """Episodes on the real HF-generate backend, the tiny model's EOS logit raised by 5 (a bias on the copy's output
    layer) so that turns end and the environment answers: every trained sequence equals the engine's sampled ids
    plus the template's tokens for the replies, env tokens unmasked and without sampling log-prob. Each turn after
    the first prefills only what the episode added (keep_prefixes: the KV cache of the turn before, masked holes and
    all): the same episodes, log-probs within 1e-5, as when every turn prefills the whole episode, and fewer tokens
    through the model."""
    engine = eos_biased_engine(tiny_model_path, tokenizer)
    fed = []
    engine.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    rec = Recording(engine)
    eps = Episodes(rec, tokenizer, "tiny-llama", env_factory=Again, max_prompt_length=64, max_completion_length=48)
    torch.manual_seed(0)
    ro = eps.run([ROW] * 6, [1] * 6, SamplingParams(max_new_tokens=48))
    assert tokenizer.decode(ro.prompt_ids[0]).endswith("Add two and three. Be brief.<|end|><|assistant|>")
    assert episode_is_token_exact(ro, rec.calls, tokenizer.pad_token_id) >= 2, "too few second turns to check"
    replies = [tokenizer.decode(ro.response_ids[i][ro.env_mask[i]]) for i in range(6)]
    assert any("<|user|>again 1<|end|><|assistant|>" in r for r in replies), replies
    assert ro.sequence_mask.sum(-1).max() <= 48  # the whole episode within max_completion_length

    kept, fed[:] = sum(fed), []
    whole = Episodes(Whole(engine), tokenizer, "tiny-llama", env_factory=Again, max_prompt_length=64,
                     max_completion_length=48)
    torch.manual_seed(0)
    again = whole.run([ROW] * 6, [1] * 6, SamplingParams(max_new_tokens=48))
    assert torch.equal(again.response_ids, ro.response_ids) and torch.equal(again.env_mask, ro.env_mask)
    assert torch.allclose(again.sampling_logprobs, ro.sampling_logprobs, atol=1e-5)
    assert kept < sum(fed), (kept, sum(fed))


class TRLStyleEnv:
    """Written for TRL's GRPOTrainer(environment_factory=...): reset(**kwargs), a tool method, get_reward."""

    def reset(self, **kwargs):
        assert "prompt" in kwargs and "chosen" in kwargs, kwargs  # the dataset row's columns
        self.calls = 0
        return None

    def lookup(self, word: str) -> str:
        """Look a word up.

        Args:
            word: the word
        """
        self.calls += 1
        return word.upper()

    def get_reward(self) -> float:
        return 10.0


def test_trl_style_environment_runs_through_grpo(tmp_path):
    """The class above, unchanged, through recipes/grpo.py on the tiny model with HF generate for 1 step (a whole
    update): the run ends, get_reward's 10 is added to the kind-reply reward (so reward/mean >= 10), the tool metrics
    are logged and samples.jsonl holds whole episodes with their messages."""
    env_file = tmp_path / "env.py"
    env_file.write_text("import json\n\n" + __import__("inspect").getsource(TRLStyleEnv))
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--config", "recipes/configs/grpo_tiny.yaml", "--output_dir", str(out),
                               "--max_steps", "1", "--prompts_per_step", "2", "--num_generations", "2",
                               "--max_completion_length", "8", "--max_prompt_length", "400", "--max_length", "512",
                               "--dataset_test_split", "none", "--logging_steps", "1",
                               "--environment_factory", f"{env_file}:TRLStyleEnv"]), timeout=240)
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert len(rows) == 1 and rows[0]["reward/mean"] >= 10, rows
    assert all(k in rows[-1] for k in ("tools/call_frequency", "tools/failure_frequency", "episode/turns",
                                       "episode/env_token_share"))
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["messages"][0]["role"] == "system" and "lookup" in sample["messages"][0]["content"]
    assert sample["messages"][-1]["role"] == "assistant"


# ---- the same check on the vLLM backends (slow) -----------------------------------------------------------------

def short_turns(model, tokenizer, steps: int = 15, prompts=(ROW["prompt"][0]["content"] + " Be brief.",),
                replies=("again 1", "again 2", "again 3")) -> None:
    """A few AdamW steps on conversations of short assistant turns ("ok" then EOS), one per prompt, the user's
    `replies` between the turns, so that sampled turns end and the environment gets to answer (the random tiny
    model almost never samples EOS)."""
    chats = []
    for prompt in prompts:
        turns = [{"role": "user", "content": prompt}]
        for reply in replies:
            turns += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": reply}]
        chats.append(torch.tensor([tokenizer.apply_chat_template(turns[:-1], tokenize=True, return_dict=False)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        ids = chats[step % len(chats)]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def vllm_episodes(engine, tokenizer) -> dict:
    """6 seeded episodes of `Again` on `engine` (weights already synced): the token-exact replay's result."""
    rec = Recording(engine)
    eps = Episodes(rec, tokenizer, "tiny-llama", env_factory=Again, max_prompt_length=64, max_completion_length=48)
    ro = eps.run([ROW] * 6, [1] * 6, SamplingParams(max_new_tokens=48, seed=7))
    return {"continued": episode_is_token_exact(ro, rec.calls, tokenizer.pad_token_id),
            "turns": [e["turns"] for e in ro.episodes]}


@pytest.mark.slow
def test_episode_tokens_exact_vllm_server(vllm_server, tokenizer, tiny_model_path):
    """The same on the session's shared vLLM server (the client sends token ids; the weights are synced first), and
    an OpenAI-SDK agent's episodes through the endpoint (tests/rollout/test_agents.py)."""
    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import VLLMServer

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path)
    short_turns(model, tokenizer)
    client = VLLMServer(vllm_server.url, tokenizer, probe_prompts=[], probe_threshold=1e-3, max_retries=3,
                        backoff_s=0.5, connect_timeout_s=5, request_timeout_s=120)
    try:
        client.load_weights(model, version=1)
        out = vllm_episodes(client, tokenizer)
        from test_agents import agent_episodes  # an OpenAI-SDK agent through the endpoint, token-exact

        agents = agent_episodes(client, tokenizer, seed=7)
    finally:
        client.close()
    print(out, agents)
    assert out["continued"] >= 2, out
    assert agents["merged"] >= 2 and agents["split"] >= 2, agents


@pytest.fixture(scope="module")
def short_turns_path(tmp_path_factory, tiny_model_path, tokenizer):
    """The tiny model after short_turns on embedded-task prompts, saved: greedy, it answers every turn "ok" and ends
    it, and the example feedback environment asks again."""
    from verl_kit.data import load_split
    from verl_kit.models import TINY_PREFS, load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path)
    prompts = [r["prompt"][0]["content"] for r in load_split(TINY_PREFS, "train").select(range(16))]
    short_turns(model, tokenizer, 48, prompts, ["Please say it more kindly."] * 2)
    out = tmp_path_factory.mktemp("short_turns")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.slow
def test_ppo_lora_episodes_zero3_equals_one_process(tmp_path, short_turns_path):
    """recipes/ppo.py with LoRA (policy and critic adapters) on episodes of the example feedback environment (the
    `respond` path), 2 steps on HF generate, greedy (top_k 1) from the short-turns model, so every episode has 2 or 3
    turns (ok, "Please say it more kindly.", ok, ...) and both runs draw the same ones: ZeRO-3 x2 (2 prompts per
    process) gives one process's losses, grad norms and values (the critic and GAE see sampled tokens only:
    verl_kit.algos.gae skips the environment's), and the adapter is exported."""
    args = ["--config", "recipes/configs/ppo_tiny.yaml", "--model_name_or_path", short_turns_path, "--max_steps", "2",
            "--prompts_per_step", "4", "--max_completion_length", "40", "--dataset_test_split", "none",
            "--logging_steps", "1", "--top_k", "1", "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
            "--lora_dropout", "0", "--environment_factory", "examples/environments.py:KindFeedback"]
    run(recipe_cmd("ppo.py", [*args, "--output_dir", str(tmp_path / "one")]), timeout=240)
    run(launch_cmd("zero3.yaml", 2, "ppo.py", [*args, "--output_dir", str(tmp_path / "z3")]), timeout=300)
    one, two = numbers(tmp_path / "one"), numbers(tmp_path / "z3")
    print({s: {k: one[s][k] for k in sorted(one[s]) if "loss" in k or "turns" in k} for s in one})
    for step in (1, 2):
        # every episode reaches the environment's reply at least once (respond path); how many ask again depends on
        # the greedy text of the short-turns model, which varies with the machine's float reductions
        assert one[step]["episode/turns"] >= 2 and one[step]["episode/env_token_share"] > 0.3, one[step]
        for k in ("reward/mean", "episode/turns", "episode/env_token_share", "actor/pg_loss", "critic/vf_loss",
                  "grad_norm", "critic/grad_norm"):
            assert two[step][k] == pytest.approx(one[step][k], rel=1e-3, abs=1e-6), (step, k, one[step], two[step])
    assert one[2]["actor/pg_loss"] != one[1]["actor/pg_loss"]  # the update changed the policy
    assert one[1]["critic/grad_norm"] > 0 and one[2]["critic/grad_norm"] > 0  # the critic's adapter trains
    assert_adapter_export(tmp_path / "z3" / "final")
