"""Agents the kit did not write (`--agent module.py:fn`): any agent loop written against the OpenAI chat-completions
API trains with GRPO or PPO. Each episode runs `fn(client, row)` (plain or async) with its own OpenAI client, whose
base URL is the run's endpoint (rollout.endpoint: loopback, a key per episode) and whose requests the policy answers
through the run's rollout backend (HF generate, colocated vLLM, a vLLM server). `fn` returns the episode's reward,
or None (then `--reward_fn` scores the final conversation, TRL's convention); one that raises, times out
(`--agent_timeout_s`) or returns anything else ends as a counted failure (episode/env_errors, scored
--reward_fallback or 0), and the run goes on.

What the endpoint served is what the trainer trains on, token for token. The endpoint renders each request's messages
(and `tools`) with the policy's chat template itself, so it knows the prompt ids; a request whose history echoes the
episode's previous request and the reply it was served, plus new messages (tool results, a user turn), is built as
an episode's next turn is (rollout.episodes): the previous ids, then the template's tokens for the new messages.
When a request's prompt ids extend the previous call's prompt and completion token for token (the prefix
property), the calls merge into one training sequence whose inserted tokens are masked out of the loss, exactly as an
environment's episode; when they do not (the agent rewrote or summarised its history, or ran a sub-agent), the call
starts a new training sample of the same episode. An episode's samples share its score: GRPO's group advantage is
computed over episodes and given to each of their samples; PPO scores each sample with the episode's reward at its
last token and runs GAE within it (docs/agents.md).

Batching: a generation serves every request waiting when all running episodes wait on the endpoint, or when none
arrived for a moment (`GATHER_S`); so concurrent agents share one `generate` call as an environment's turns do.
Bounds: `--max_completion_length` is each training sequence's budget (sampled plus inserted tokens, as an episode's),
`--max_tool_calling_iterations` the calls after the first; a request beyond either is answered with an empty
completion, finish_reason "length", and the episode is marked truncated. Sampling is the run's (temperature, top-p,
top-k): the request's are ignored, its max_tokens only lowers the budget; `n` > 1 is refused (rollout.endpoint: what
it serves and refuses, streaming and the Responses API included). tool_choice "required" or a named function writes
the start of a call into the prompt (inserted tokens, not trained on) for the policy to continue; "none" parses no
call; parallel_tool_calls false keeps the first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from verl_kit.errors import UserError
from verl_kit.rollout.chat import ChatRenderer
from verl_kit.rollout.endpoint import Endpoint, EndpointError, Request
from verl_kit.rollout.tools import TOOL_CALL, parse_tool_calls
from verl_kit.rollout.types import (
    Prompts,
    Rollout,
    RolloutBackend,
    Sample,
    SamplingParams,
    episode_info,
    generate_turn,
    rollout_of_samples,
)

logger = logging.getLogger(__name__)

GATHER_S = 0.02  # a batch waits this long for one more request while some running agent is not waiting on it


@dataclass
class _Episode:
    row: dict
    row_no: int
    prompt: list[int]  # the dataset prompt's ids: the row of an episode that made no call
    samples: list[Sample] = field(default_factory=list)
    history: list[tuple] = field(default_factory=list)  # the last request's messages and its reply, normalised
    tools: str = ""  # the last request's tools, as JSON
    served: dict = field(default_factory=dict)  # normalised reply -> the text the policy wrote
    messages: list[dict] = field(default_factory=list)  # the last request's conversation and reply, for logs
    calls: int = 0
    tool_calls: int = 0
    truncated: bool = False
    done: bool = False
    reward: float = 0.0
    failure: str | None = None
    jobs: queue.Queue | None = None  # its generate call's: the endpoint's requests, the episode's start and end


def _text(content) -> str:
    """A message's content as text (OpenAI's list of parts: their text, joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _arguments(args):
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _normal(m: dict) -> tuple:
    """What of an OpenAI message the template sees, comparable: role, text, tool calls (name, arguments), and a
    tool result's call id and name."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                                  sort_keys=True))
                  for c in m.get("tool_calls") or [] if isinstance(c, dict))
    return (m.get("role"), _text(m.get("content")), calls, m.get("tool_call_id") or "", m.get("name") or "")


class AgentEpisodes:
    """Episodes run by an agent function (`agent`, loaded from --agent) over `engine` (a RolloutBackend): a
    rollout.types.EpisodeRunner. `max_calls`: requests per episode at most (--max_tool_calling_iterations + 1), None:
    unbounded."""

    environments: tuple[str, ...] = ()

    def __init__(self, engine: RolloutBackend, tokenizer, model_name: str, agent, max_concurrency: int = 64,
                 timeout_s: float = 600.0, max_prompt_length: int = 512, max_completion_length: int = 64,
                 max_calls: int | None = None):
        if len(inspect.signature(agent).parameters) < 2:
            raise UserError(f"--agent {getattr(agent, '__qualname__', agent)!r}: an agent takes (client, row)")
        self.engine, self.tokenizer, self.agent = engine, tokenizer, agent
        self.name = getattr(agent, "__qualname__", type(agent).__name__)
        self.max_concurrency, self.timeout_s, self.max_calls = max_concurrency, timeout_s, max_calls
        self.max_prompt_length, self.max_completion_length = max_prompt_length, max_completion_length
        # the template's rendering: tool descriptions (or the fallback system prompt), tool results, turn suffixes
        self.chat = ChatRenderer(tokenizer, model_name)
        # turns are spliced onto the previous ids only where the template appends (else each call re-renders)
        self.appends = self.chat.appends(with_tools=True)
        self.endpoint = Endpoint(os.path.basename(model_name.rstrip("/")) or "policy", timeout_s + 60)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="verl_kit-agents", daemon=True).start()
        self._limit = asyncio.Semaphore(max_concurrency)  # episodes running at once, over every generate call
        self._warned = False

    # ---- one generation: the agents run, the endpoint's requests are served here ------------------------------
    def generate(self, split: Prompts, idx: list[int], params: SamplingParams, source: str = "dataset") -> Rollout:
        """params.n episodes of each dataset row `split.rows[i]`, i in `idx`, in that
        order: one row per episode, or several where its calls did not extend each other (Rollout.episode).
        Re-entrant: calls from several threads (--partial_rollout's groups) each serve their own episodes' requests."""
        index = Prompts.each(idx, params.n)
        jobs: queue.Queue = queue.Queue()
        eps = [_Episode(copy.deepcopy(split.rows[i]), i + 1, list(split.ids[i]), jobs=jobs) for i in index]
        running = asyncio.run_coroutine_threadsafe(self._run_all(eps), self._loop)
        try:
            self._serve(eps, jobs, params)
        except BaseException:
            running.cancel()  # the run stops: its agents with it
            raise
        running.result()  # every episode has ended (each within its timeout)
        if all(ep.failure is not None for ep in eps):  # a broken agent or setup, not bad luck: said every time
            logger.warning("--agent %s: all %d episodes of this batch failed, nothing to learn from (the first: %s)",
                           self.name, len(eps), eps[0].failure)
        return self.to_rollout(eps)

    def _serve(self, eps: list[_Episode], inbox: queue.Queue, params: SamplingParams) -> None:
        """Answer the endpoint's requests of `eps` (from `inbox`) until every episode has ended, batching those that
        wait together."""
        running = ended = 0
        jobs: list[Request] = []
        seed = params.seed  # each generation's: params.seed, then + the samples generated before it
        last_progress = time.monotonic()
        while ended < len(eps):
            try:
                kind, item = inbox.get(timeout=GATHER_S if jobs else 1.0)
            except queue.Empty:
                if jobs:
                    seed = self._answer(jobs, params, seed)
                    jobs, last_progress = [], time.monotonic()
                elif time.monotonic() - last_progress > self.timeout_s + 120:
                    raise RuntimeError(f"--agent {self.name}: no request and no episode ended for "
                                       f"{self.timeout_s + 120:g} s (an async agent blocking its event loop?)"
                                       ) from None
                continue
            last_progress = time.monotonic()
            if kind == "start":
                running += 1
            elif kind == "end":
                running, ended = running - 1, ended + 1
            else:
                jobs.append(item)
            if jobs and len(jobs) >= running:  # every running agent waits on the endpoint
                seed = self._answer(jobs, params, seed)
                jobs = []
        for job in jobs:  # requests of episodes that ended meanwhile (a timed-out agent's thread)
            job.reply(EndpointError(410, "the episode has ended"))

    # ---- the agents (on the event-loop thread) ----------------------------------------------------------------
    async def _run_all(self, eps: list[_Episode]) -> None:
        await asyncio.gather(*(self._run(ep) for ep in eps))

    async def _run(self, ep: _Episode) -> None:
        import openai

        async with self._limit:
            key = self.endpoint.open(ep)
            ep.jobs.put(("start", ep))
            asynchronous = inspect.iscoroutinefunction(self.agent)
            kw = dict(base_url=self.endpoint.url, api_key=key, max_retries=0, timeout=self.timeout_s)
            client = openai.AsyncOpenAI(**kw) if asynchronous else openai.OpenAI(**kw)
            try:
                if asynchronous:
                    result = await asyncio.wait_for(self.agent(client, copy.deepcopy(ep.row)), self.timeout_s)
                else:
                    result = await asyncio.wait_for(asyncio.wrap_future(_on_thread(self.agent, client,
                                                                                   copy.deepcopy(ep.row))),
                                                    self.timeout_s)
                if result is not None and (isinstance(result, bool) or not isinstance(result, (int, float))
                                           or not math.isfinite(result)):
                    raise TypeError(f"returned {result!r}, not a finite number or None")
                ep.reward = 0.0 if result is None else float(result)
            except (asyncio.TimeoutError, TimeoutError):
                self._fail(ep, f"timed out after {self.timeout_s:g} s (--agent_timeout_s)")
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's agent: counted, never the run
                self._fail(ep, f"{type(e).__name__}: {e}")
            finally:
                self.endpoint.close_key(key)
                ep.done = True
                ep.jobs.put(("end", ep))
                await (client.close() if asynchronous else asyncio.to_thread(client.close))

    def _fail(self, ep: _Episode, why: str) -> None:
        ep.failure = f"agent {self.name} {why.splitlines()[0] if why else why}"
        ep.reward = math.nan
        if not self._warned:
            self._warned = True
            logger.warning("%s (dataset row %d); the episode ends there, the run goes on: such episodes are counted in "
                           "episode/env_errors and scored --reward_fallback, or 0 (warned once)", ep.failure,
                           ep.row_no)

    # ---- a batch of requests -------------------------------------------------------------------------------------
    def _answer(self, jobs: list[Request], params: SamplingParams, seed: int | None) -> int | None:
        """Render each request, generate for those with room in one call (sample i seeded seed + i), record and
        reply. Returns the next generation's seed."""
        todo = []
        for job in jobs:
            ep = job.episode
            if ep.done:
                job.reply(EndpointError(410, "the episode has ended"))
                continue
            try:
                todo.append((job, *self._prepare(ep, job.body)))
            except EndpointError as e:
                job.reply(e)
        todo = [t for t in todo if self._reply_if_spent(*t)]
        if not todo:
            return seed
        try:
            turns = generate_turn(self.engine, [t[1] for t in todo], [t[3] for t in todo], params, seed)
        except BaseException:
            for job, *_ in todo:
                job.reply(EndpointError(500, "the rollout engine failed; the run stops"))
            raise
        for (job, prompt, sample, _, messages, forced), (ids, logprobs, ended, versions) in zip(todo, turns):
            job.reply(self._record(job.episode, job.body, prompt, sample, ids, logprobs, ended, messages, forced,
                                   versions))
        return None if seed is None else seed + len(todo)

    def _forced(self, body: dict) -> str:
        """The start of a tool call a request's tool_choice asks for ("required": a call; a named function: a call of
        it), written into the prompt for the policy to continue (inserted tokens: not trained on); "" otherwise."""
        choice = body.get("tool_choice")
        if choice == "required":
            return "<tool_call>"
        if isinstance(choice, dict):
            return '<tool_call>{"name": ' + json.dumps(choice["function"]["name"]) + ', "arguments": '
        return ""

    def _prepare(self, ep: _Episode, body: dict):
        """(prompt ids, the sample it extends or None for a new one, its token budget, the messages, the forced start
        of a tool call) of a request."""
        messages, tools = body["messages"], json.dumps(body.get("tools") or [], sort_keys=True)
        normal = [_normal(m) for m in messages]
        prompt = None
        n = len(ep.history)
        if (self.appends and ep.history and tools == ep.tools and len(normal) > n and normal[:n] == ep.history
                and ep.samples and not ep.samples[-1].truncated):
            try:  # the next turn of the previous call: its ids, then the template's tokens for the new messages
                last = ep.samples[-1]
                prompt = last.prompt + last.ids + self.chat.suffix_ids(self._template(messages[n:], messages, ep))
            except UserError:
                prompt = None
        if prompt is None:
            shown = self._template(messages, messages, ep)
            schemas = [t for t in body.get("tools") or [] if isinstance(t, dict)]
            try:
                prompt = self.chat.render_prompt(copy.deepcopy(shown), schemas)
            except Exception as e:  # noqa: BLE001 - the agent's messages: a 400, never the run
                raise EndpointError(400, f"the chat template cannot render these messages: {type(e).__name__}: "
                                         f"{e}") from None
        forced = self._forced(body)
        if forced:
            prompt = prompt + self.tokenizer.encode(forced, add_special_tokens=False)
        last = ep.samples[-1] if ep.samples else None
        extends = (last is not None and not last.truncated and len(prompt) > len(last.prompt) + len(last.ids)
                   and prompt[:len(last.prompt) + len(last.ids)] == last.prompt + last.ids)
        if extends:
            budget = self.max_completion_length - (len(prompt) - len(last.prompt))
        else:
            longest = self.max_prompt_length + self.max_completion_length
            if len(prompt) > longest:
                raise EndpointError(400, f"the prompt is {len(prompt)} tokens, over --max_prompt_length + "
                                         f"--max_completion_length ({longest})", "context_length_exceeded")
            budget = self.max_completion_length
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(asked, int) and asked > 0:
            budget = min(budget, asked)
        if self.max_calls is not None and ep.calls >= self.max_calls:
            budget = 0
        return prompt, last if extends else None, budget, messages, forced

    def _reply_if_spent(self, job: Request, prompt, sample, budget: int, messages, forced: str) -> bool:
        """A request with no token left answers an empty completion ("length") and truncates its episode; True
        when the request is to be generated."""
        if budget > 0:
            return True
        job.episode.truncated = True
        if job.episode.samples:
            job.episode.samples[-1].truncated = True
        job.reply(self._completion(job.body, "", [], "length", prompt, [], []))
        return False

    def _template(self, messages: list[dict], context: list[dict], ep: _Episode) -> list[dict]:
        """OpenAI messages as the chat template takes them: text contents; a reply the policy wrote as the text it
        wrote (its tool calls included, as the model writes them); a tool result as rollout.episodes inserts it
        (a `tool` message, or the fallback's user message), named after its call."""
        names = {c.get("id"): c.get("function", {}).get("name") for m in context if m.get("role") == "assistant"
                 for c in m.get("tool_calls") or [] if isinstance(c, dict)}
        out = []
        for m in messages:
            role = m.get("role")
            if role == "assistant":
                text = ep.served.get(_normal(m))
                if text is None:  # not what the policy wrote: its text, and its tool calls Hermes-style
                    text = _text(m.get("content")) + "".join(
                        "<tool_call>" + json.dumps({"name": c.get("function", {}).get("name"),
                                                    "arguments": _arguments(c.get("function", {}).get("arguments"))})
                        + "</tool_call>" for c in m.get("tool_calls") or [] if isinstance(c, dict))
                out.append({"role": "assistant", "content": text})
            elif role == "tool":
                out.append(self.chat.env_message("tool", _text(m.get("content")),
                                                 m.get("name") or names.get(m.get("tool_call_id"))))
            else:
                out.append({"role": role, "content": _text(m.get("content"))})
        return out

    def _record(self, ep: _Episode, body: dict, prompt: list[int], sample: Sample | None, ids: list[int],
                logprobs: list[float], ended: bool, messages: list[dict], forced: str = "",
                versions: list[int] | None = None) -> dict:
        """Keep a served call as training data and return its chat.completion (tool calls parsed unless tool_choice
        is "none"; the first alone with parallel_tool_calls false)."""
        if sample is None:
            sample = Sample(list(prompt))
            ep.samples.append(sample)
        else:
            sample.add(prompt[len(sample.prompt) + len(sample.ids):], None)
        sample.add(ids, logprobs, versions)
        sample.truncated = not ended
        ep.truncated |= not ended
        ep.calls += 1
        text = forced + self.tokenizer.decode(ids, skip_special_tokens=True)
        parse = body.get("tools") and body.get("tool_choice") != "none"
        calls = [c for c in (parse_tool_calls(text, self.tokenizer) if parse else []) if isinstance(c, dict)]
        if body.get("parallel_tool_calls") is False:
            calls = calls[:1]
        ep.tool_calls += len(calls)
        reply = self._completion(body, text, calls, "length" if not ended else "tool_calls" if calls else "stop",
                                 prompt, ids, logprobs)
        message = reply["choices"][0]["message"]
        ep.served[_normal(message)] = text
        ep.history = [_normal(m) for m in messages] + [_normal(message)]
        ep.tools = json.dumps(body.get("tools") or [], sort_keys=True)
        ep.messages = [*copy.deepcopy(messages), {"role": "assistant", "content": text}]
        return reply

    def _completion(self, body: dict, text: str, calls: list[dict], finish: str, prompt: list[int],
                    ids: list[int], logprobs: list[float]) -> dict:
        """An OpenAI chat.completion of one choice (tool calls as `tool_calls`, their text out of `content`; with
        `logprobs`, each token's sampling log-prob; with vLLM's `return_token_ids`, the prompt's and reply's ids)."""
        message = {"role": "assistant", "content": (TOOL_CALL.sub("", text).strip() or None) if calls else text}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for c in calls]
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(ids, logprobs)]}
        out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
               "model": self.endpoint.model_id, "choices": [choice],
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                         "total_tokens": len(prompt) + len(ids)}}
        if body.get("return_token_ids"):  # vLLM's extension: the ids served
            out["prompt_token_ids"], choice["token_ids"] = list(prompt), list(ids)
        return out

    # ---- the batch --------------------------------------------------------------------------------------------
    def to_rollout(self, eps: list[_Episode]) -> Rollout:
        """One row per training sample (an episode that made no call: its dataset prompt and no response)."""
        rows = [(e, ep, s) for e, ep in enumerate(eps)
                for s in ep.samples or [Sample(ep.prompt, truncated=ep.truncated)]]
        infos = [episode_info(ep.calls, ep.tool_calls, ep.messages or ep.row.get("prompt"),
                              env_errors=int(ep.failure is not None), reward_error=ep.failure, env_class=self.name,
                              reward_source="agent", failure=ep.failure) for _, ep, _ in rows]
        return rollout_of_samples([s for *_, s in rows], self.tokenizer.pad_token_id, [ep.reward for _, ep, _ in rows],
                                  infos, episode=[e for e, *_ in rows])

    def close(self) -> None:
        self.endpoint.close()
        self._loop.call_soon_threadsafe(self._loop.stop)


def _on_thread(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a daemon thread of its own (a plain agent: one that hangs past its timeout is abandoned there,
    its key closed, and cannot keep the process alive)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            result, error = None, e
        else:
            error = None
        try:
            future.set_exception(error) if error is not None else future.set_result(result)
        except concurrent.futures.InvalidStateError:  # abandoned: the episode timed out
            pass

    threading.Thread(target=run, name="verl_kit-agent", daemon=True).start()
    return future


def make_agent_episodes(cfg, engine: RolloutBackend, tokenizer, model_name: str, max_prompt_length: int,
                        max_completion_length: int) -> AgentEpisodes:
    """The AgentEpisodes of a run's EnvironmentConfig (--agent, --agent_max_concurrency, --agent_timeout_s,
    --max_tool_calling_iterations)."""
    from verl_kit.config import load_object

    agent = load_object("agent", cfg.agent, "function")
    max_calls = None if cfg.max_tool_calling_iterations is None else cfg.max_tool_calling_iterations + 1
    return AgentEpisodes(engine, tokenizer, model_name, agent, cfg.agent_max_concurrency, cfg.agent_timeout_s,
                         max_prompt_length, max_completion_length, max_calls)
