"""The rollout boundary: what a backend is given (SamplingParams), what it returns (Rollout, a batch whose fields
declare their role) and the methods every backend implements (RolloutBackend: HF generate in rollout.hf, a vLLM
engine in the training process in rollout.vllm_engine, a vLLM server in rollout.vllm_client); the episode contract
over a backend (EpisodeRunner: single-turn, environments and tools in rollout.episodes, agents in rollout.agents),
what its runners record (Sample, episode_info), the one generation turn they share (generate_turn) and the one
builder of their Rollout (rollout_of_samples)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, runtime_checkable

import torch

from verl_kit.data.prompts import Prompts


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_new_tokens: int = 32
    n: int = 1  # samples per prompt
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    seed: int | None = None  # per-request sampling seed (vLLM backends)
    stop: list[str] | None = None  # stop strings (vLLM backends; HF generate stops on EOS)

    def sample_seed(self, i: int) -> int | None:
        """The seed of sample i of a call (of len(prompts) * n): the call's seed + i, so a sample depends only on the
        seed and its position, not on what the engine generated before nor on how it batches (resume exactness)."""
        return None if self.seed is None else self.seed + i


@runtime_checkable
class RolloutBackend(Protocol):
    """Every rollout backend. All are called on every training process at the same points (the weight sync and
    the probe are collective under ZeRO-3). `per_sample_seeds`: the backend draws every sample from its own seed
    (SamplingParams.sample_seed), so the online recipes seed each step and a resumed run regenerates its samples."""

    per_sample_seeds: bool

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """len(prompts) * params.n responses to the prompt token ids."""

    def load_weights(self, actor, version: int = 0) -> dict:
        """Weight sync from the unwrapped `actor` (collective); `version`: the optimizer step that produced the
        weights. Returns sync/* (and the probe's rollout/*) metrics."""

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per-token log-probs of seqs[i][1:] given their prefixes (temperature 1), as the backend computes them."""

    def keep_prefixes(self) -> AbstractContextManager:
        """Within it, successive generate calls may reuse what earlier calls computed for the prompts they extend
        (multi-turn episodes: each turn's prompt is the episode so far); a no-op where the engine caches prefixes
        itself (vLLM)."""

    def close(self) -> None:
        """Release the engine (processes, memory, shared-memory slots)."""


@runtime_checkable
class EpisodeRunner(Protocol):
    """What turns prompts into episodes over a RolloutBackend: single-turn (rollout.episodes.SingleTurn), an
    environment or tools (rollout.episodes.Episodes), an agent through the run's endpoint (rollout.agents.
    AgentEpisodes). rollout.Rollouts knows only this; tests/rollout/test_runners.py runs every runner through the
    same checks."""

    engine: RolloutBackend  # what generates every turn (Rollouts syncs its weights)
    environments: tuple[str, ...]  # the environments' names of the multi-environment form (env/<name>/*), else ()

    def generate(self, split: Prompts, idx: list[int], params: SamplingParams, source: str = "dataset") -> Rollout:
        """params.n episodes of each prompt of `split` in `idx`, in that order (Prompts.each): a Rollout whose rows
        are those episodes' training sequences (one each, or several: Rollout.episode); a prompt numbered i + 1
        (its dataset row) in errors about `source`."""

    def close(self) -> None:
        """Release what the runner holds (an agent's endpoint)."""


# A Rollout field's role: TOKEN (B, R), right-padded; ROW (B,), one value per row; EPISODE (B,), one value per episode,
# repeated on each of its rows (an --agent's episode may span rows); GROUPING: the `episode` field itself.
TOKEN, ROW, EPISODE, GROUPING = "token", "row", "episode", "grouping"


def _field(role: str, pad=0, optional: bool = True):
    """A Rollout field: its `role` (TOKEN fields are right-padded with `pad` when batches of other widths are joined),
    None by default when `optional`."""
    return field(default=None, metadata={"role": role, "pad": pad}) if optional else \
        field(metadata={"role": role, "pad": pad})


@dataclass
class Rollout:
    """B training rows (sequences) of E episodes: one row per episode, except an --agent's episode whose calls did not
    extend each other (rollout.agents); prompt i's samples are the episodes i*n .. i*n + n - 1. Every field declares
    its role (TOKEN, ROW or EPISODE, in its metadata) and is None or has B rows, so joining, selecting and
    checkpointing are written once over the fields (concat_rollouts, select_rows, state_dict): a new field is one
    line here.

    per row, from the backend (rollout.types.RolloutBackend.generate):
    prompt_ids         list of B token-id lists   the prompt of each response (unpadded, for packing)
    response_ids       (B, R) long                sampled tokens, pad after the end (the EOS is kept)
    response_mask      (B, R) bool                True on response tokens up to and including the EOS
    sampling_logprobs  (B, R) float32             log-prob of each token under the sampling distribution
                                                  (temperature, top-k, top-p applied), 0 outside the mask
    truncated          (B,) bool                  no EOS within max_new_tokens
    versions           (B, R) long                the policy version (weight sync) that sampled each token, -1
                                                  outside the sampled tokens (vLLM reports it per token; a batch of
                                                  a backend that does not is given its one version by Rollouts)
    per episode, set by rollout.Rollouts (the batch carries what it was generated for):
    prompt_index       list of B ints             each row's prompt, as an index into the split it was asked from
    rows               list of B dicts            each row's dataset row (`prompt` and the columns rewards read)
    from multi-turn episodes (rollout.episodes, rollout.agents), per row but env_reward (per episode):
    env_mask           (B, R) bool                True on the tokens the environment inserted (tool results,
                                                  replies, the template's turn markers); the response is
                                                  response_mask | env_mask, and response_mask (the loss mask, the
                                                  sampling log-probs) covers only what the model sampled
    env_reward         (B,) float32               each episode's get_reward() (0 without one; an agent's return
                                                  value), as returned: NaN where it raised; Rewards.environment
                                                  checks and scores it
    episodes           list of B dicts            rollout.types.episode_info: turns, tool_calls, tool_failures,
                                                  env_tokens, the messages, the environment's name
                                                  (multi-environment form) and class, env_errors, reward_error,
                                                  reward_source
    the grouping:
    episode            list of B ints or None     each row's episode, numbered 0.. in row order (an episode's rows
                                                  are consecutive); None: one row per episode. Per-episode values
                                                  (E,) come from per_episode(), go back to rows with per_row()
    """

    prompt_ids: list[list[int]] = _field(ROW, optional=False)
    response_ids: torch.Tensor = _field(TOKEN, 0, optional=False)
    response_mask: torch.Tensor = _field(TOKEN, False, optional=False)
    sampling_logprobs: torch.Tensor = _field(TOKEN, 0.0, optional=False)
    truncated: torch.Tensor = _field(ROW, optional=False)
    versions: torch.Tensor | None = _field(TOKEN, -1)
    prompt_index: list[int] | None = _field(EPISODE)
    rows: list[dict] | None = _field(EPISODE)
    env_mask: torch.Tensor | None = _field(TOKEN, False)
    env_reward: torch.Tensor | None = _field(EPISODE)
    episodes: list[dict] | None = _field(ROW)
    episode: list[int] | None = field(default=None, metadata={"role": GROUPING})

    # ---- rows and episodes --------------------------------------------------------------------------------------
    def first_rows(self) -> list[int]:
        """The first row of each episode (every row without per-call samples)."""
        if self.episode is None:
            return list(range(len(self.prompt_ids)))
        return [i for i, e in enumerate(self.episode) if i == 0 or self.episode[i - 1] != e]

    def last_rows(self) -> list[int]:
        """The last row of each episode: its final call."""
        if self.episode is None:
            return list(range(len(self.prompt_ids)))
        return [i for i, e in enumerate(self.episode) if i + 1 == len(self.episode) or self.episode[i + 1] != e]

    def row_episode(self) -> torch.Tensor:
        """(B,) long: each row's episode."""
        return torch.tensor(self.episode if self.episode is not None else range(len(self.prompt_ids)),
                            dtype=torch.long)

    def per_episode(self, values: torch.Tensor) -> torch.Tensor:
        """(B, ...) values of the rows -> (E, ...), each episode's from its first row (its rows share them)."""
        return values[self.first_rows()]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """(E, ...) values of the episodes -> (B, ...): each row gets its episode's."""
        return values[self.row_episode()]

    def episode_rows(self, episodes: list[int]) -> list[int]:
        """The rows of `episodes` (indices into the episodes), in that order."""
        rows: dict[int, list[int]] = {}
        for i, e in enumerate(self.row_episode().tolist()):
            rows.setdefault(e, []).append(i)
        return [i for e in episodes for i in rows[e]]

    def with_prompts(self, episode_prompt: list[int], split_rows: list[dict]) -> Rollout:
        """This rollout with `prompt_index` and `rows` set: `episode_prompt` (E,) is each episode's prompt, an index
        into the split whose dataset rows are `split_rows`."""
        index = [episode_prompt[e] for e in self.row_episode().tolist()]
        return replace(self, prompt_index=index, rows=[split_rows[i] for i in index])

    @property
    def sequence_mask(self) -> torch.Tensor:
        """(B, R) bool: every token of the response, sampled or inserted by the environment."""
        return self.response_mask if self.env_mask is None else self.response_mask | self.env_mask

    @property
    def costs(self) -> list[int]:
        """Tokens of each row's forward pass (prompt and whole response, environment tokens included): the cost that
        train.distributed.micro_batches packs by."""
        return [len(p) + int(n) for p, n in zip(self.prompt_ids, self.sequence_mask.sum(-1))]

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every field by name (torch.save-able)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> Rollout:
        """The rollout of a state_dict (a field a checkpoint predates is None)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def concat_rollouts(batches: list[Rollout]) -> Rollout:
    """The rows of several rollouts, in order, as one: TOKEN fields right-padded to the longest (with the field's pad:
    nothing reads past a response's end); a field None in any batch is None."""
    R = max(b.response_ids.shape[1] for b in batches)
    out, episode, offset = {}, [], 0
    for b in batches:
        episode += (b.row_episode() + offset).tolist()
        offset += len(b.first_rows())
    for f in fields(Rollout):
        values = [getattr(b, f.name) for b in batches]
        if f.metadata["role"] == GROUPING or any(v is None for v in values):
            continue
        if f.metadata["role"] == TOKEN:
            out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, R - v.shape[1]), value=f.metadata["pad"])
                                     for v in values])
        else:
            out[f.name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]
    return Rollout(**out, episode=_numbered(episode))


def select_rows(ro: Rollout, rows: list[int]) -> Rollout:
    """The rollout of `rows` (indices into ro's rows), in that order."""
    ix = torch.tensor(rows, dtype=torch.long)
    out = {}
    for f in fields(ro):
        v = getattr(ro, f.name)
        if v is not None:
            out[f.name] = v[ix] if isinstance(v, torch.Tensor) else [v[i] for i in rows]
    if "episode" in out:
        out["episode"] = _numbered(out["episode"])
    return Rollout(**out)


def _numbered(episode: list[int]) -> list[int] | None:
    """Each row's episode renumbered 0.. in row order; None when every row is its own episode."""
    first = {e: n for n, e in enumerate(dict.fromkeys(episode))}
    out = [first[e] for e in episode]
    return None if out == list(range(len(out))) else out


# ---- episodes: what the runners record and the one builder of their Rollout -----------------------------------------
@dataclass
class Sample:
    """One training sequence of an episode: a prompt and what followed it, sampled (with its sampling log-probs) or
    inserted by the environment."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    truncated: bool = False
    versions: list[int] | None = field(default_factory=list)  # per token (-1: inserted); None: a backend without

    def add(self, ids: list[int], logprobs: list[float] | None, versions: list[int] | None = None) -> None:
        """Append tokens: sampled ones with their log-probs and the policy versions that sampled them (None: the
        backend does not report them), or (logprobs None) the environment's."""
        self.ids += ids
        self.sampled += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if logprobs is None:
            versions = [-1] * len(ids)
        self.versions = None if versions is None or self.versions is None else self.versions + versions


def episode_info(turns: int, tool_calls: int, messages, tool_failures: int = 0, environment: str | None = None,
                 env_errors: int = 0, reward_error: str | None = None, env_class: str | None = None,
                 reward_source: str = "environment", failure: str | None = None) -> dict:
    """What a row of a multi-turn episode records beside its tokens (Rollout.episodes; env_tokens is added by
    rollout_of_samples): assistant turns (an agent's calls), tool calls and failed ones, the conversation for
    samples.jsonl, the environment's name in the multi-environment form and its class, env_errors (an environment
    method or the agent raised), reward_error (why get_reward gave no number), the reward source's name and
    `failure`, the first error that ended the episode in one line (None when none did)."""
    return {"turns": turns, "tool_calls": tool_calls, "tool_failures": tool_failures, "messages": messages,
            "environment": environment, "env_errors": env_errors, "reward_error": reward_error,
            "env_class": env_class, "reward_source": reward_source, "failure": failure}


def rollout_of_samples(samples: list[Sample], pad_id: int, env_reward: list[float] | None = None,
                       infos: list[dict] | None = None, episode: list[int] | None = None) -> Rollout:
    """The one builder of a Rollout from samples, one row each (a backend's responses, the runners' episodes): their
    tokens right-padded with `pad_id`, response_mask on the sampled tokens. Multi-turn (`infos`, episode_info per
    row): env_mask on the inserted tokens, `env_reward` per row, the infos with each row's env_tokens, and `episode`,
    each row's episode (None: one row each)."""
    B, R = len(samples), max(1, max(len(s.ids) for s in samples))
    ids = torch.full((B, R), pad_id, dtype=torch.long)
    sampled = torch.zeros((B, R), dtype=torch.bool)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    versions = torch.full((B, R), -1, dtype=torch.long) if all(s.versions is not None for s in samples) else None
    for i, s in enumerate(samples):
        n = len(s.ids)
        ids[i, :n] = torch.tensor(s.ids, dtype=torch.long)
        sampled[i, :n] = torch.tensor(s.sampled, dtype=torch.bool)
        logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        if versions is not None:
            versions[i, :n] = torch.tensor(s.versions, dtype=torch.long)
    ro = Rollout([s.prompt for s in samples], ids, sampled, logprobs, torch.tensor([s.truncated for s in samples]),
                 versions)
    if infos is None:
        return ro
    inserted = torch.zeros((B, R), dtype=torch.bool)
    for i, s in enumerate(samples):
        inserted[i, :len(s.ids)] = ~sampled[i, :len(s.ids)]
    infos = [{**info, "env_tokens": int(sum(not x for x in s.sampled))} for s, info in zip(samples, infos)]
    return replace(ro, env_mask=inserted, env_reward=torch.tensor(env_reward, dtype=torch.float32), episodes=infos,
                   episode=None if episode is None else _numbered(episode))


def generate_turn(engine: RolloutBackend, prompts: list[list[int]], budgets: list[int], params: SamplingParams,
                  seed: int | None) -> list[tuple[list[int], list[float], bool, list[int] | None]]:
    """One turn of several episodes in one generate call: (sampled ids, their log-probs, ended, the policy versions
    that sampled them or None) for each prompt, cut to its token budget; `ended`: the turn ended in EOS within its
    budget."""
    ro = engine.generate(prompts, replace(params, n=1, max_new_tokens=max(budgets), seed=seed, ignore_eos=False,
                                          stop=None))
    out = []
    for j, budget in enumerate(budgets):
        m = ro.response_mask[j]
        ids, logprobs = ro.response_ids[j][m].tolist(), ro.sampling_logprobs[j][m].tolist()
        versions = None if ro.versions is None else ro.versions[j][m].tolist()[:budget]
        out.append((ids[:budget], logprobs[:budget], not bool(ro.truncated[j]) and len(ids) <= budget, versions))
    return out


@dataclass
class Scores:
    """What a rollout's B responses scored (rewards.Rewards.of_rollout):
    total    (B,) float32           the sequence score the advantages use (weighted sum of the sources, penalties)
    sources  {name: (B,) float32}   each reward source's own scores, unweighted (the rewards/<name>/* metrics)
    failure  str | None             why a source scored every response --reward_fallback (nothing to learn from it)
    """

    total: torch.Tensor
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    failure: str | None = None

    def select(self, rows: list[int]) -> Scores:
        """The scores of `rows`, in that order (as select_rows)."""
        ix = torch.tensor(rows, dtype=torch.long)
        return Scores(self.total[ix], {k: v[ix] for k, v in self.sources.items()}, self.failure)

    @staticmethod
    def concat(batches: list[Scores]) -> Scores:
        """The scores of several batches, in order, as one (as concat_rollouts)."""
        return Scores(torch.cat([b.total for b in batches]),
                      {k: torch.cat([b.sources[k] for b in batches]) for k in batches[0].sources},
                      batches[0].failure if all(b.failure for b in batches) else None)
