"""Rollouts for the online recipes, synchronous or generated ahead of the trainer (`--async_rollout`).

Synchronous: step t's batch is generated when step t asks for it, by the policy of step t (the weights synced after
update t-1), and the engine idles while the trainer updates.

One-step-off (`--async_rollout --max_staleness 1`): when step t takes its batch, the batch of step t+1 is handed to a
rollout thread, which generates it with the weights the engine has now (version t) while the trainer rewards,
scores and updates on batch t. The weight sync after update t first waits for that generation (the engine takes new
weights only when idle), then pushes version t+1. So the batch of step t+1 comes from the policy of step t: one step
stale, `rollout/staleness` = step - version of the weights that sampled it. `--max_staleness K` keeps K batches ahead;
K = 0 runs every generation through the same thread but only when its step asks for it (no overlap, the numbers of
the synchronous recipe). The off-policy samples are corrected with importance weights (verl_kit.algos.off_policy).

Partial rollouts (`--partial_rollout`, with --async_rollout on vLLM servers): the sync after update t does not wait
for the generation in flight. The engine is paused keeping its requests (vLLM's pause, mode "keep"), loads version
t+1, drops the KV of the old policy (the prefix cache and the running requests', which are recomputed), and resumes:
each response continues under the new weights, and vLLM reports which weights sampled each token
(Rollout.versions; the importance weights correct token by token from the engine's own sampling log-probs).
`rollout/version_lag_max` and `_mean` say how far behind the trained policy the batch's tokens were sampled. And
groups stream (InFlightRollouts): each prompt's group is its own request, a step takes the first groups to complete,
so a long response enters a later step instead of holding its own back; a group with a token more than
max_staleness syncs old is dropped (rollout/groups_dropped_stale).

Everything that uses the engine (generation, held-out evaluation) runs on the one rollout thread, in the order it was
asked for, so the engine sees the same sequence of requests in every run; the weight sync and its probe run on the
main thread with the engine idle. A generation that fails raises in the main thread; one that takes longer than
`timeout_s` stops the run with an error (the thread is a daemon: it cannot keep a failed run alive).

Resume: a checkpoint taken after the sync of version s holds the batches already generated for steps s .. s+K-1
by older weights (`state_dict`, one file per rank); resuming restores them and regenerates the rest from the restored
weights. With per-sample seeds derived from the step (the colocated vLLM engine) a resumed run is bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import NamedTuple

import torch

from verl_kit.algos.sampling import group_rows, informative_groups, select_groups
from verl_kit.config import EnvironmentConfig, RolloutConfig, TrainConfig, VLLMConfig
from verl_kit.errors import UserError
from verl_kit.rollout.agents import make_agent_episodes
from verl_kit.rollout.backends import make_backend, served_adapter_rank, start_servers
from verl_kit.rollout.curriculum import DifficultyCurriculum
from verl_kit.rollout.episodes import SingleTurn, make_episodes
from verl_kit.rollout.prompts import evaluate
from verl_kit.rollout.types import EpisodeRunner, Prompts, Rollout, SamplingParams, Scores, concat_rollouts, select_rows
from verl_kit.rollout.vllm_server import ServerProcess
from verl_kit.train.distributed import all_reduce_max, reduce_metrics, step_indices, step_seed

logger = logging.getLogger(__name__)


class Rollouts:
    """Batches of the prompts of `split`: `request(step, k) -> (prompt indices, SamplingParams)` is what step `step`
    generates (k = 0), or its k-th further batch (--dynamic_sampling); a pure function of both, so it can be asked
    ahead of time and again after a resume; each batch carries its prompts' indices (`Rollout.prompt_index`).
    `max_staleness`: None for synchronous rollouts, else how many steps ahead batches are generated. `runner`: the
    rollout.types.EpisodeRunner that plays the episodes over its `engine` (a RolloutBackend, synced by load_weights);
    `servers`: the vLLM servers the run started, stopped by close(); `eval_params`: the held-out evaluation's sampling;
    `pass_threshold`: the score a held-out response passes at; `max_failed_steps`: steps in a row with nothing to
    learn from (on every process: every episode failed, or a reward source scored every response its fallback) after
    which observe() stops the run in one line (0: never); `curriculum`: the --curriculum table `request` draws from
    (observe() feeds it), saved with the batches."""

    in_flight = False  # a weight sync waits for the generation in flight (InFlightRollouts: it does not)

    def __init__(self, runner: EpisodeRunner, split: Prompts,
                 request: Callable[[int, int], tuple[list[int], SamplingParams]], total_steps: int,
                 max_staleness: int | None = None, timeout_s: float = 1800, servers: Sequence[ServerProcess] = (),
                 eval_params: SamplingParams | None = None, pass_threshold: float = 1.0, max_failed_steps: int = 0,
                 curriculum: DifficultyCurriculum | None = None):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness {max_staleness}: use >= 0")
        self.runner = runner
        self.split, self.request, self.total_steps = split, request, total_steps
        self.servers, self.eval_params, self.pass_threshold = list(servers), eval_params, pass_threshold
        self.ahead, self.timeout_s = max_staleness, timeout_s
        self.max_failed_steps, self.failed_steps = max_failed_steps, 0
        self.unchecked: int | None = None  # the step whose own batch observe() has not seen yet
        self.curriculum = curriculum
        self.version = 0  # of the weights the engine has
        self.batches: dict[int, tuple[Future, int]] = {}  # step -> (its rollout, the version that generates it)
        self._jobs: queue.Queue = queue.Queue()
        if max_staleness is not None:
            threading.Thread(target=self._serve, name="verl_kit-rollout", daemon=True).start()

    # ---- the rollout thread -------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                    future.set_exception(e)

    def _call(self, fn, *args) -> Future:
        """Run fn(*args) on the rollout thread after everything asked before it; synchronous: here and now."""
        future: Future = Future()
        if self.ahead is None:
            future.set_result(fn(*args))
        else:
            self._jobs.put((future, fn, args))
        return future

    def _wait(self, future: Future, what: str):
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"{what} did not finish within {self.timeout_s:g} s (--rollout_timeout_s): the "
                               "rollout engine is stuck or far too slow") from None

    def _submit(self, step: int) -> None:
        if step < self.total_steps and step not in self.batches:
            idx, params = self.request(step, 0)
            self.batches[step] = (self._call(self._generate, self.split, idx, params), self.version)

    def _generate(self, split: Prompts, idx: list[int], params: SamplingParams, source: str = "dataset") -> Rollout:
        """The one generation path: params.n samples (episodes) of each prompt of `split` in `idx`."""
        ro = self.runner.generate(split, idx, params, source)
        return ro.with_prompts(Prompts.each(idx, params.n), split.rows)

    # ---- the trainer's side -------------------------------------------------------------------------------------
    def get(self, step: int) -> tuple[Rollout, dict]:
        """The batch of `step` and how far behind the trained policy it was sampled (collective): rollout/staleness
        (step - the version of the weights when the batch was asked for) and, over its sampled tokens,
        rollout/version_lag_max and _mean (step - the version that sampled each token: with --partial_rollout a
        response continues under the weights of every sync it spans). Hands the batches of the next
        `max_staleness` steps to the rollout thread first, so they generate while this one trains."""
        for s in range(step, step + (self.ahead or 0) + 1):
            self._submit(s)
        future, version = self.batches.pop(step)
        ro = with_versions(self._wait(future, f"the rollout of step {step}"), version)
        self.unchecked = step
        return ro, {"rollout/staleness": step - version, **version_lag(ro, step)}

    def _stop_if_failing(self, ro: Rollout, scored: Scores, step: int) -> None:
        """Count the steps in a row with nothing to learn from on every process (collective): every episode failed,
        or a reward source scored every response --reward_fallback (Scores.failure). At max_failed_steps stop the run
        in one line naming this process's most common failure, rather than train on nothing."""
        if not self.max_failed_steps:
            return
        episodes = [ro.episodes[i] for i in ro.first_rows()] if ro.episodes is not None else []
        episodes_failed = bool(episodes) and all(e.get("env_errors") for e in episodes)
        failed = episodes_failed or scored.failure is not None
        self.failed_steps = self.failed_steps + 1 if -all_reduce_max(-float(failed)) else 0
        if self.failed_steps < self.max_failed_steps:
            return
        steps = f"{self.failed_steps} steps in a row", f"(steps {step - self.failed_steps + 2}-{step + 1})"
        if episodes_failed:
            why, n = Counter(e.get("failure") or "an environment method raised" for e in episodes).most_common(1)[0]
            raise UserError(f"every episode of {steps[0]} failed {steps[1]}, nothing to learn from; the most common "
                            f"failure ({n} of {len(episodes)} on this process): {why} (--max_failed_steps)")
        raise UserError(f"every response of {steps[0]} {steps[1]} got --reward_fallback from one reward source, "
                        f"nothing to learn from it: {scored.failure} (--max_failed_steps)")

    def more(self, step: int, k: int) -> Rollout:
        """The k-th further batch of `step` (k >= 1; --dynamic_sampling), generated now with the engine's weights
        (those of the step's own batch when synchronous), in turn with the queued batches."""
        idx, params = self.request(step, k)
        ro = self._wait(self._call(self._generate, self.split, idx, params), f"batch {k} of step {step}")
        return with_versions(ro, self.version)

    def observe(self, ro: Rollout, scored: Scores) -> dict:
        """A scored batch of the train split (collective: every process, once per batch, the step's own and each
        further one). The step's own batch counts towards --max_failed_steps (a step with nothing to learn from stops
        the run in one line there); with --curriculum the batch is recorded in the table: its curriculum/* metrics,
        else {}."""
        if self.unchecked is not None:
            step, self.unchecked = self.unchecked, None
            self._stop_if_failing(ro, scored, step)
        if self.curriculum is None:
            return {}
        first = ro.first_rows()
        self.curriculum.observe([ro.prompt_index[i] for i in first], ro.per_episode(scored.total))
        return self.curriculum.metrics()

    @property
    def environments(self) -> tuple[str, ...]:
        """The environments' names of a multi-environment run (rollout_metrics' env/<name>/*), else ()."""
        return self.runner.environments

    def evaluate(self, accelerator, split: Prompts, score, batch_size: int, extra=None) -> dict:
        """Held-out evaluation (rollout.prompts.evaluate) of `split` with the run's evaluation sampling, generated in
        turn with the queued batches: eval/reward_mean, eval/response_length (and eval/pass@k with several responses
        per prompt, and eval/<name> of `extra`'s per-response values)."""
        def generate(idx: list[int], params: SamplingParams) -> Rollout:
            return self._wait(self._call(self._generate, split, idx, params, "the held-out split"), "a generation")

        return evaluate(accelerator, generate, split, self.eval_params, score, batch_size, self.pass_threshold,
                        extra, self.environments)

    def load_weights(self, actor, version: int) -> dict:
        """Weight sync (collective), once the engine has finished every batch handed to it; with partial rollouts
        at once, the engine paused meanwhile keeping what it generates (the requests continue under the new
        weights)."""
        if self.in_flight:
            metrics = self.runner.engine.load_weights(actor, version=version, in_flight=True)
        else:
            for step, (future, _) in sorted(self.batches.items()):
                self._wait(future, f"the rollout of step {step}")
            metrics = self.runner.engine.load_weights(actor, version=version)
        self.version = version
        return metrics

    def close(self) -> None:
        if self.ahead is not None:
            self._jobs.put((None, None, None))
        self.runner.close()
        self.runner.engine.close()
        for server in self.servers:
            server.stop()

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches generated but not yet trained on (call after load_weights: none is in flight then)."""
        out = {}
        for step, (future, version) in self.batches.items():
            ro = self._wait(future, f"the rollout of step {step}")
            out[step] = {"version": version, **ro.state_dict()}
        return {"batches": out, **({"curriculum": self.curriculum.state_dict()} if self.curriculum else {})}

    def load_state_dict(self, state: dict) -> None:
        if self.curriculum is not None:
            if "curriculum" not in state:
                raise UserError("--curriculum difficulty: the checkpoint has no curriculum state (saved by a run "
                                "without one)")
            self.curriculum.load_state_dict(state["curriculum"])
        for step, b in state["batches"].items():
            ro = Rollout.from_state_dict(b)
            if ro.rows is None and ro.prompt_index is not None:  # saved before the batch carried its dataset rows
                ro = replace(ro, rows=[self.split.rows[i] for i in ro.prompt_index])
            future: Future = Future()
            future.set_result(ro)
            self.batches[int(step)] = (future, b["version"])


class Group(NamedTuple):
    """A prompt's group asked for by InFlightRollouts: its rollout, the step it was asked for, the weights version the
    engine held then, and its place in the order asked."""

    future: Future
    step: int
    version: int
    order: int = 0


class InFlightRollouts(Rollouts):
    """Rollouts with --partial_rollout: generation never waits for the trainer, and a step never waits for a whole
    batch.

    Every prompt of the steps asked for (up to max_staleness steps ahead, as Rollouts asks) is a group of its own (its
    n samples, or n episodes), sent to the engine at once: the engine always holds the next steps' groups while the
    trainer updates, and a weight sync pauses it keeping them (the requests continue under the new weights,
    Rollouts.load_weights). A step takes the first groups to complete, the oldest asked first among those complete,
    as many as a batch has prompts on this process: a slow group (a long response, a long episode) does not hold the
    step back, it enters a later step. A group with a token sampled more than max_staleness syncs before the step that
    would train on it is dropped and counted (rollout/groups_dropped_stale) rather than regenerated, which would
    sample the same long tail again; the next steps' prompts fill in. Which groups enter which step depends on timing:
    a run is not reproducible (nor is a server's sampling: it is unseeded)."""

    in_flight = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ahead is None:
            raise ValueError("InFlightRollouts generate ahead of the trainer: give max_staleness")
        self.pending: list[Group] = []  # in the order asked
        self._order = itertools.count()
        self.asked = -1  # the last step whose prompts were asked for
        self.dropped = 0  # stale groups dropped since the last step (rollout/groups_dropped_stale)
        self._groups = ThreadPoolExecutor(256, thread_name_prefix="verl_kit-group")

    def _ask(self, until: int) -> None:
        """Send every prompt of the steps up to `until` not asked for yet, each its own group."""
        for step in range(self.asked + 1, until + 1):
            idx, params = self.request(step, 0)
            self.pending += [Group(self._groups.submit(self._generate, self.split, [i], params), step, self.version,
                                   next(self._order)) for i in idx]
        self.asked = max(self.asked, until)

    def get(self, step: int) -> tuple[Rollout, dict]:
        """The first groups to complete (see the class docstring), as many as step `step` has prompts here, and how far
        behind they were sampled (collective: Rollouts.get's metrics, and rollout/groups_dropped_stale)."""
        # The run's first batch (nothing asked before it) is its own prompts only: asked with the next steps' at the
        # same moment, the first groups to complete would be the shortest of them all (a bias towards short
        # responses, or episodes without a tool call, at step 1). The next steps are asked once it is taken.
        first = self.asked < step and not self.pending
        ahead = min(step + self.ahead, self.total_steps - 1)
        self._ask(step if first else ahead)
        need, taken = len(self.request(step, 0)[0]), []
        deadline = time.time() + self.timeout_s
        while len(taken) < need:
            done = [g for g in self.pending if g.future.done()]
            if not done and not self.pending:
                self._ask(self.asked + 1)  # stale groups were dropped: the next step's prompts fill in
            elif not done:
                if time.time() > deadline:
                    raise RuntimeError(f"the rollout of step {step} did not finish within {self.timeout_s:g} s "
                                       "(--rollout_timeout_s): the rollout engine is stuck or far too slow")
                wait([g.future for g in self.pending], max(deadline - time.time(), 0), FIRST_COMPLETED)
            for group in done[:need - len(taken)]:
                self.pending.remove(group)
                ro = with_versions(group.future.result(), group.version)  # a generation's error raises here
                sampled = ro.versions[ro.response_mask]
                if sampled.numel() and step - int(sampled.min()) > self.ahead:
                    self.dropped += 1
                else:
                    taken.append((group, ro))
        if first:
            self._ask(ahead)
        self.unchecked = step
        taken.sort(key=lambda t: t[0].order)  # in the order asked, whatever the order they completed in
        ro = concat_rollouts([r for _, r in taken])
        dropped, self.dropped = self.dropped, 0
        return ro, {"rollout/staleness": step - min(g.version for g, _ in taken), **version_lag(ro, step),
                    "rollout/groups_dropped_stale": reduce_metrics({"n": float(dropped)})["n"]}

    def close(self) -> None:
        self._groups.shutdown(wait=False, cancel_futures=True)
        super().close()

    def state_dict(self) -> dict:
        """The groups asked for and not yet trained on, each once complete (a checkpoint waits for those in flight),
        with their tokens' versions; a resume trains on them first, as they were."""
        groups = [{"step": g.step, "version": g.version, **self._wait(g.future, f"a group of step {g.step}")
                   .state_dict()} for g in self.pending]
        return {"groups": groups, "asked": self.asked, "dropped": self.dropped,
                **({"curriculum": self.curriculum.state_dict()} if self.curriculum else {})}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({"batches": {}, **{k: v for k, v in state.items() if k == "curriculum"}})
        for g in state["groups"]:
            future: Future = Future()
            future.set_result(Rollout.from_state_dict(g))
            self.pending.append(Group(future, g["step"], g["version"], next(self._order)))
        self.asked, self.dropped = state["asked"], state["dropped"]


def with_versions(ro: Rollout, version: int) -> Rollout:
    """`ro` with Rollout.versions: as the engine reported them, else `version` (the weights the engine held
    throughout: without partial rollouts a sync waits for the generation) on every sampled token."""
    if ro.versions is not None:
        return ro
    return replace(ro, versions=torch.where(ro.response_mask, version, -1))


def version_lag(ro: Rollout, step: int) -> dict:
    """rollout/version_lag_max and rollout/version_lag_mean: how many syncs behind the policy trained at `step` its
    batch's sampled tokens were sampled, the oldest and the mean over every process's tokens (collective)."""
    lag = step - ro.versions[ro.response_mask].double()
    t = reduce_metrics({"sum": float(lag.sum()), "n": float(lag.numel())},
                       {"max": float(lag.max()) if lag.numel() else 0.0})
    return {"rollout/version_lag_max": t["max"], "rollout/version_lag_mean": t["sum"] / max(t["n"], 1.0)}


def dynamic_sampling(rollouts: Rollouts, step: int, first: Rollout, scored: Scores, score,
                     group_size: int, max_batches: int) -> tuple[Rollout, Scores, dict]:
    """DAPO's dynamic sampling (algos.sampling): groups whose scores are all equal are dropped, and further batches of
    the step (Rollouts.more, scored by `score(rollout) -> Scores`) are generated until every process holds as many
    informative groups as its first batch had groups, at most `max_batches` batches in all. Each process then keeps
    the same number of groups, the fewest any process found (so all run the same number of micro-batches and
    collectives), or, when some process found none, its first batch as it is. The number of batches is decided on
    all processes together (collective). Returns the step's rollout, its scores and rollout/* metrics (sums over
    processes)."""
    target = len(first.first_rows()) // group_size  # an agent's episode may span rows: groups are of episodes
    batches, all_scores = [first], [scored]
    informative = informative_groups(first.per_episode(scored.total), group_size)
    while True:
        fewest = int(-all_reduce_max(-float(informative.sum())))
        if fewest >= target or len(batches) >= max_batches:
            break
        ro = rollouts.more(step, len(batches))
        batches.append(ro)
        all_scores.append(score(ro))
        rollouts.observe(ro, all_scores[-1])
        informative = torch.cat([informative, informative_groups(ro.per_episode(all_scores[-1].total), group_size)])
    take = min(fewest, target)
    if take < target:
        logger.warning("--dynamic_sampling: step %d found %d informative group(s) of %d on some process after %d "
                       "generation batches (--max_num_gen_batches): %s", step, take, target, len(batches),
                       f"training on {take} group(s) per process" if take else "training on its first batch as it is")
    every = concat_rollouts(batches)
    rows = every.episode_rows(group_rows(select_groups(informative, target, take), group_size).tolist())
    counts = reduce_metrics({"rollout/groups_generated": len(informative), "rollout/groups_kept": take})
    return (select_rows(every, rows), Scores.concat(all_scores).select(rows),
            {**counts, "rollout/gen_batches": len(batches)})


def sampling_params(cfg: RolloutConfig, n: int) -> SamplingParams:
    """A step's sampling: the RolloutConfig flags, `n` responses per prompt (the recipe's num_generations)."""
    return SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_completion_length, n, cfg.ignore_eos)


def make_rollouts(accelerator, actor, tokenizer, split: Prompts, *, rollout: RolloutConfig, vllm: VLLMConfig,
                  train: TrainConfig, model_path: str, total_steps: int, num_generations: int,
                  env: EnvironmentConfig | None = None) -> Rollouts:
    """The online recipes' rollouts: the `--rollout` backend (and the vLLM server a run starts for itself) for the
    unwrapped `actor` (the model at `model_path`), with multi-turn episodes of each dataset row when `env` names an
    environment, tools or an agent, synchronous or (--async_rollout) ahead by --max_staleness, over the prompts of
    `split`, `num_generations` responses each, for `total_steps` steps. The config pieces are named: `rollout`
    (sampling, backend), `vllm` (engine, sync, probe), `train` (lengths, seed), `env` (none: single-turn). The engine
    holds no trained weights yet: the recipe resumes, then syncs (Rollouts.load_weights).

    A step generates its prompts on this process (train.distributed.step_indices). The colocated engine seeds every
    sample from (seed, step, rank, index), so a resumed run draws the same ones, and evaluates with fixed seeds
    (`Rollouts.eval_params`)."""
    cfg, vllm_cfg, env_cfg = rollout, vllm, env
    rank, world = accelerator.process_index, accelerator.num_processes
    lora_rank = served_adapter_rank(cfg, vllm_cfg, accelerator, actor)
    servers, urls = start_servers(cfg, vllm_cfg, accelerator, model_path, train.max_length, train.seed, lora_rank)
    backend = make_backend(cfg, vllm_cfg, accelerator, actor, model_path, tokenizer,
                           split.ids[:vllm_cfg.vllm_probe_size], urls, train.max_length, train.seed, lora_rank)
    sampling = sampling_params(cfg, num_generations)
    # the episodes: an --agent's, an environment's or tools' (multi-turn), else one generation per sample
    if env_cfg is not None and env_cfg.agent:
        runner = make_agent_episodes(env_cfg, backend, tokenizer, train.model_name_or_path, train.max_prompt_length,
                                     cfg.max_completion_length)
    elif env_cfg is not None and env_cfg.enabled:
        runner = make_episodes(env_cfg, backend, tokenizer, train.model_name_or_path, train.max_prompt_length,
                               cfg.max_completion_length)
    else:
        runner = SingleTurn(backend)

    def seed(step: int, k: int = 0) -> int | None:
        return step_seed(train.seed + k, step, rank) if backend.per_sample_seeds else None

    curriculum = (DifficultyCurriculum(len(split.ids), cfg.curriculum_easy_weight, cfg.curriculum_hard_weight,
                                       cfg.pass_threshold) if cfg.curriculum == "difficulty" else None)

    def request(step: int, k: int):
        # batch k >= 1 of a step (--dynamic_sampling) reads the prompts of another seeded order of the split: the
        # step's own batch (k = 0) stays what it is without the flag, and every batch is a function of (step, k)
        # (and, with --curriculum, of the solve rates observed when it is asked for)
        if curriculum is not None:
            idx = curriculum.indices(step, cfg.prompts_per_step, train.seed + k, rank, world)
        else:
            idx = step_indices(len(split.ids), step, cfg.prompts_per_step, train.seed + k, rank, world)
        return idx, replace(sampling, seed=seed(step, k))

    kind = InFlightRollouts if cfg.partial_rollout else Rollouts
    return kind(runner, split, request, total_steps, cfg.max_staleness if cfg.async_rollout else None,
                cfg.rollout_timeout_s, servers=servers, pass_threshold=cfg.pass_threshold,
                eval_params=replace(sampling, n=cfg.num_generations_eval, seed=seed(-1)),
                max_failed_steps=cfg.max_failed_steps, curriculum=curriculum)
