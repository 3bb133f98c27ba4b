"""The runners of rollout.types.EpisodeRunner that the kit plays itself: SingleTurn (one generation per sample), and
Episodes, multi-turn over any rollout backend: the model calls tools or talks with an environment, and the tokens
trained on are exactly the tokens the engine sampled plus those the environment inserted.

An episode starts from a dataset row: one environment instance (`--environment_factory`), `reset(**row)` (its string
appended to the last user message, as TRL), the prompt rendered with the tool schemas. With several environments
(TRL's dict form, `--environment_factory name=spec,...`) each row's `environment` column picks one, and its prompt
shows that environment's tools only. Each turn the backend generates from the episode's token ids so far (never
re-rendered text), through the RolloutBackend protocol, so HF generate, a colocated vLLM engine and a vLLM server all
run the same loop. A turn that ends in EOS is read for tool calls (rollout.tools); their results, or the
environment's `respond(text)` reply, enter as the tokens the chat template adds for those messages (rollout.chat:
the suffix ids, exact for a template with the prefix property, checked once at start).

`--max_completion_length` bounds the whole episode (sampled plus environment tokens, TRL's meaning); a turn cut by
it, or an environment message that would not fit, ends the episode truncated. `--max_tool_calling_iterations` bounds
the rounds of tool calls. The Rollout's response_mask covers only sampled tokens, env_mask the inserted ones.

Nothing the model writes stops the run: a tool call that does not parse, names no tool, raises or times out is an
error result the model sees (tools/failure_frequency); `respond` or `get_reward` raising, or `reset`, `respond` or
`get_reward` past --env_timeout_s, ends the episode, counted in episode/env_errors (get_reward's score is then
--reward_fallback, or 0: Rewards.environment). Only `reset` raising, which sees the dataset row and not the model,
stops the run in one line.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
from dataclasses import dataclass, field

from verl_kit.config import EnvironmentConfig, load_object
from verl_kit.deadline import DeadlineExceeded, call_with_deadline
from verl_kit.errors import UserError
from verl_kit.rollout.chat import ChatRenderer, check_prefix_property
from verl_kit.rollout.tools import (
    call_tool,
    environment_tools,
    parse_tool_calls,
    tool_schema,
)
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


@dataclass
class _Episode(Sample):
    """An episode's one training sequence (its prompt and response, rollout.types.Sample) and its state."""

    env: object | None = None
    tools: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)  # the conversation as text, for samples.jsonl
    done: bool = False
    turns: int = 0
    tool_rounds: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    environment: str | None = None  # its name in the multi-environment form
    row_no: int = 0  # in errors and warnings
    env_errors: int = 0  # respond or get_reward raised
    reward_error: str | None = None  # why get_reward gave no reward
    failure: str | None = None  # the first environment error of the episode, in one line


def _call(fn, *args):
    result = fn(*args)
    return asyncio.run(result) if inspect.isawaitable(result) else result


class SingleTurn:
    """The trivial runner (rollout.types.EpisodeRunner): one generation per sample from its prompt's token ids."""

    environments: tuple[str, ...] = ()

    def __init__(self, engine: RolloutBackend):
        self.engine = engine

    def generate(self, split: Prompts, idx: list[int], params: SamplingParams, source: str = "dataset") -> Rollout:
        """params.n responses to each prompt `split.ids[i]`, i in `idx`, in that order."""
        return self.engine.generate([split.ids[i] for i in idx], params)

    def close(self) -> None:
        pass


class Episodes:
    """Runs episodes on `engine` (a RolloutBackend). `env_factory`: a class or callable making one environment per
    episode, a dict of them by name (each row's `environment` column picks one, TRL's multi-environment form), or
    None; `tools`: plain tool functions, offered in every episode; `model_name`: for the one-line errors."""

    def __init__(self, engine: RolloutBackend, tokenizer, model_name: str, env_factory=None, tools=(),
                 max_tool_calling_iterations: int | None = None, tool_timeout_s: float | None = None,
                 max_prompt_length: int = 512, max_completion_length: int = 64, env_timeout_s: float | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.multi_env = isinstance(env_factory, dict)
        self.env_factories = env_factory if self.multi_env else {None: env_factory} if env_factory else {}
        self.tools = {t.__name__: t for t in tools}
        self.max_iterations, self.tool_timeout_s = max_tool_calling_iterations, tool_timeout_s
        self.env_timeout_s = env_timeout_s
        self.max_prompt_length, self.max_completion_length = max_prompt_length, max_completion_length
        self.chat = ChatRenderer(tokenizer, model_name)
        self._warned: set[tuple[str, str]] = set()  # (class, method) of the environment errors warned about
        probes = [factory() for factory in self.env_factories.values()]
        self.has_tools = bool(self.tools) or any(environment_tools(probe) for probe in probes)
        for probe in probes:
            if not callable(getattr(probe, "reset", None)):
                raise UserError(f"--environment_factory {type(probe).__name__}: an environment must define "
                                "reset(**row)")
        check_prefix_property(tokenizer, model_name, self.has_tools and self.chat.native_tools)

    @property
    def environments(self) -> tuple[str, ...]:
        """The environments' names in the multi-environment form (each gets its own env/<name>/* metrics), else ()."""
        return tuple(sorted(self.env_factories)) if self.multi_env else ()

    # ---- episodes ---------------------------------------------------------------------------------------------
    def _environment(self, row: dict, row_no: int, source: str) -> tuple[object | None, dict]:
        """A new environment for `row` (None without one) and the row as its reset gets it: in the multi-environment
        form the `environment` column names it and is not passed on (TRL's behaviour)."""
        if not self.multi_env:
            return (self.env_factories[None]() if self.env_factories else None), row
        name = row.get("environment")
        if name not in self.env_factories:
            raise UserError(f"{source} row {row_no}: field 'environment' is {name!r}, not one of "
                            f"{sorted(self.env_factories)} (--environment_factory)")
        return self.env_factories[name](), {k: v for k, v in row.items() if k != "environment"}

    def start(self, row: dict, row_no: int, source: str) -> _Episode:
        env, reset_row = self._environment(row, row_no, source)
        prompt = row.get("prompt")
        messages = copy.deepcopy(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        observation = hung = None
        if env is not None:
            try:
                observation = self._env_call(env, "reset", **reset_row)
            except DeadlineExceeded as e:  # a hang: that episode fails, the run goes on
                hung = e
            except Exception as e:  # noqa: BLE001 - the user's environment: one line naming it and the row
                raise UserError(f"{type(env).__name__}.reset failed on {source} row {row_no}: "
                                f"{type(e).__name__}: {e}") from None
            if observation is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
        tools = {**self.tools, **(environment_tools(env) if env is not None else {})}
        schemas = [tool_schema(fn) for fn in tools.values()]
        shown = copy.deepcopy(messages)
        ids = self.chat.render_prompt(shown, schemas)
        if len(ids) > self.max_prompt_length:
            raise UserError(f"{source} row {row_no}: the prompt with its tool descriptions is {len(ids)} tokens, over "
                            f"--max_prompt_length {self.max_prompt_length} (cutting it would lose the tools)")
        ep = _Episode(ids, env=env, tools=tools, messages=shown,
                      environment=row.get("environment") if self.multi_env else None, row_no=row_no)
        if hung is not None:  # no turn is played and get_reward is not asked: scored --reward_fallback, or 0
            ep.done, ep.reward_error = True, self._env_error(ep, "reset", hung)
        return ep

    def _env_call(self, env, method: str, *args, **kwargs):
        """env.<method>(...) (run to completion when async), cut at --env_timeout_s (verl_kit.deadline: interrupted
        on the main thread, abandoned on another): DeadlineExceeded past it."""
        fn = getattr(env, method)
        return call_with_deadline(lambda: _call(lambda: fn(*args, **kwargs)), self.env_timeout_s,
                                  f"{type(env).__name__}.{method}")

    def react(self, ep: _Episode, text: str) -> list[dict] | None:
        """The environment's answer to an assistant turn: tool results, a reply, or None (the episode ends)."""
        calls = parse_tool_calls(text, self.tokenizer) if ep.tools else []
        if calls:
            if self.max_iterations is not None and ep.tool_rounds >= self.max_iterations:
                return None
            ep.tool_rounds += 1
            out = []
            for call in calls:
                name, result, failed = call_tool(ep.tools, call, self.tool_timeout_s)
                ep.tool_calls += 1
                ep.tool_failures += failed
                out.append(self.chat.env_message("tool", result, name))
            return out
        if ep.env is not None and callable(getattr(ep.env, "respond", None)):
            try:
                reply = self._env_call(ep.env, "respond", text)
                return None if reply is None else [self.chat.env_message("user", str(reply))]
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the environment failed on the model's text
                self._env_error(ep, "respond", e)
                return None  # the episode ends there
        return None

    def _env_error(self, ep: _Episode, method: str, e: BaseException) -> str:
        """Count an environment method that raised (episode/env_errors) and warn once per run."""
        ep.env_errors += 1
        name = type(ep.env).__name__
        what = (f"{name}.{method} did not return within {self.env_timeout_s:g} s (--env_timeout_s)"
                if isinstance(e, DeadlineExceeded) else f"{name}.{method} raised {type(e).__name__}: {e}")
        ep.failure = ep.failure or what.splitlines()[0]
        if (name, method) not in self._warned:
            self._warned.add((name, method))
            logger.warning("%s (dataset row %d); the episode ends there, the run goes on: such episodes are counted in "
                           "episode/env_errors (warned once for %s.%s)", what.splitlines()[0], ep.row_no, name, method)
        return what

    def _reward(self, ep: _Episode) -> float:
        """The episode's get_reward() (0 without one, or None); NaN where it raised or returned no number, with
        ep.reward_error set: Rewards.environment scores those (--reward_fallback, else 0)."""
        if ep.reward_error is not None:  # its reset hung
            return math.nan
        get_reward = getattr(ep.env, "get_reward", None) if ep.env is not None else None
        if not callable(get_reward):
            return 0.0
        try:
            value = self._env_call(ep.env, "get_reward")
            return 0.0 if value is None else float(value)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - counted, never the run
            ep.reward_error = self._env_error(ep, "get_reward", e)
            return math.nan

    def trace(self, row: dict, turns: list[str], row_no: int = 1, source: str = "dataset") -> list[dict]:
        """The conversation an episode of `row` shows the model when it writes the assistant texts `turns`, as
        `messages` for the SFT recipe: warm-start traces for a model that never calls the tools. The prompt is the
        episode's (under the fallback, the tools described in the system message), each turn's tool calls run for
        real and their results come back as the loop inserts them; it stops where the episode would end."""
        if self.chat.native_tools:
            raise UserError(f"{self.model_name}: the chat template renders tools itself; warm-start traces are written "
                            "for templates without tool support (tools in the system message)")
        ep = self.start(row, row_no, source)
        for text in turns:
            ep.messages.append({"role": "assistant", "content": text})
            new = self.react(ep, text)
            if not new:
                break
            ep.messages += new
        return ep.messages

    def generate(self, split, idx: list[int], params: SamplingParams, source: str = "dataset") -> Rollout:
        """params.n episodes of each dataset row `split.rows[i]`, i in `idx`, in that order (a row numbered i + 1 in
        errors): the EpisodeRunner contract."""
        index = Prompts.each(idx, params.n)
        return self.run([split.rows[i] for i in index], [i + 1 for i in index], params, source)

    def run(self, rows: list[dict], row_numbers: list[int], params: SamplingParams, source: str = "dataset"
            ) -> Rollout:
        """One episode per entry of `rows` (the caller repeats a row for each of its samples): a Rollout of
        len(rows) responses (params.n is ignored) with env_mask, env_reward and episodes set."""
        eps = [self.start(row, no, source) for row, no in zip(rows, row_numbers)]
        # HF generate then prefills only what each turn adds (the vLLM engines cache prefixes themselves)
        with self.engine.keep_prefixes():
            self._play(eps, params)
        return self.to_rollout(eps)

    def _play(self, eps: list[_Episode], params: SamplingParams) -> None:
        """The turns of `eps` until every episode is done: generate for the active ones, read each turn, insert the
        environment's answer."""
        turn, active = 0, [e for e in eps if not e.done]
        while active:
            budget = [self.max_completion_length - len(e.ids) for e in active]
            seed = None if params.seed is None else params.seed + turn * len(eps)
            turns = generate_turn(self.engine, [e.prompt + e.ids for e in active], budget, params, seed)
            for e, (ids, logprobs, ended, versions) in zip(active, turns):
                e.add(ids, logprobs, versions)
                e.turns += 1
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                e.messages.append({"role": "assistant", "content": text})
                if not ended:
                    e.done = e.truncated = True
                    continue
                new = self.react(e, text)
                if not new:
                    e.done = True
                    continue
                e.messages += new
                suffix = self.chat.suffix_ids(new)
                if len(e.ids) + len(suffix) >= self.max_completion_length:  # no room for it and one more token
                    e.done = e.truncated = True
                    continue
                e.add(suffix, None)
            active = [e for e in active if not e.done]
            turn += 1

    def close(self) -> None:
        pass

    def to_rollout(self, eps: list[_Episode]) -> Rollout:
        rewards = [self._reward(e) for e in eps]  # first: a get_reward that raises counts in env_errors
        infos = [episode_info(e.turns, e.tool_calls, e.messages, e.tool_failures, e.environment, e.env_errors,
                              e.reward_error, type(e.env).__name__ if e.env is not None else None,
                              failure=e.failure) for e in eps]
        return rollout_of_samples(eps, self.tokenizer.pad_token_id, rewards, infos)


def make_episodes(cfg: EnvironmentConfig, engine: RolloutBackend, tokenizer, model_name: str,
                  max_prompt_length: int, max_completion_length: int) -> Episodes | None:
    """The Episodes of a run's EnvironmentConfig (--environment_factory, --tools, --max_tool_calling_iterations,
    --tool_timeout_s), or None when neither an environment nor tools are given (single-turn rollouts);
    `max_completion_length` bounds a whole episode."""
    if not cfg.enabled:
        return None
    factory = None
    if cfg.environment_factory:  # module:Class, or name=module:Class,... (TRL's dict of factories)
        specs = [s.strip() for s in cfg.environment_factory.split(",") if s.strip()]
        if any("=" in s for s in specs):
            names = [s.split("=", 1)[0].strip() if "=" in s else "" for s in specs]
            if not all(names) or len(set(names)) < len(names):
                raise UserError(f"--environment_factory {cfg.environment_factory!r}: name every environment once "
                                "(name=module:Class,...) or give one module:Class")
            factory = {n: load_object("environment_factory", s.split("=", 1)[1].strip()) for n, s in zip(names, specs)}
        else:
            factory = load_object("environment_factory", cfg.environment_factory)
    tools = [load_object("tools", s) for s in (cfg.tools or "").split(",") if s.strip()]
    return Episodes(engine, tokenizer, model_name, factory, tools, cfg.max_tool_calling_iterations,
                    cfg.tool_timeout_s, max_prompt_length, max_completion_length, cfg.env_timeout_s)
