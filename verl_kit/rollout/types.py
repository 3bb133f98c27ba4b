"""The rollout boundary: what a backend is given (SamplingParams), what it returns (Rollout) and the methods every
backend implements (RolloutBackend). Backends: HF generate (rollout.hf), a vLLM engine in the training process
(rollout.vllm_engine), a vLLM server (rollout.vllm_client)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


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


@dataclass
class Rollout:
    """B = len(prompts) * n responses; prompt i's samples are rows i*n .. i*n + n - 1.

    prompt_ids         list of B token-id lists   the prompt of each response (unpadded, for packing)
    response_ids       (B, R) long                sampled tokens, pad after the end (the EOS is kept)
    response_mask      (B, R) bool                True on response tokens up to and including the EOS
    sampling_logprobs  (B, R) float32             log-prob of each token under the sampling distribution
                                                  (temperature, top-k, top-p applied), 0 outside the mask
    truncated          (B,) bool                  no EOS within max_new_tokens
    prompt_index       list of B ints or None     each response's prompt, as an index into the prompt list the
                                                  batch was asked from (set by rollout.Rollouts)
    Multi-turn episodes (rollout.episodes) add, else None:
    env_mask           (B, R) bool                True on the tokens the environment inserted (tool results,
                                                  replies, the template's turn markers); the response is
                                                  response_mask | env_mask, and response_mask (the loss mask, the
                                                  sampling log-probs) covers only what the model sampled
    env_reward         (B,) float32               each environment's get_reward() (0 without one), as returned:
                                                  NaN where it raised; Rewards.environment checks and scores it
    episodes           list of B dicts            turns, tool_calls, tool_failures, the messages of each episode,
                                                  its environment's name (multi-environment form, else None) and
                                                  class (env_class), env_errors (respond/get_reward raised) and
                                                  reward_error (why get_reward gave no number, else None)
    An agent (rollout.agents) may leave several rows per episode:
    episode            list of B ints or None     each row's episode, numbered 0.. in row order (an episode's
                                                  rows are consecutive); None: one row per episode. The rows of
                                                  an episode are the calls its agent made that did not extend the
                                                  previous call token for token: they share its score and its
                                                  advantage (first_rows, row_episode)
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampling_logprobs: torch.Tensor
    truncated: torch.Tensor
    prompt_index: list[int] | None = None
    env_mask: torch.Tensor | None = None
    env_reward: torch.Tensor | None = None
    episodes: list[dict] | None = None
    episode: list[int] | None = None

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
        """(B,) long: each row's episode, to spread per-episode values (E,) over the rows: values[ro.row_episode()]."""
        return torch.tensor(self.episode if self.episode is not None else range(len(self.prompt_ids)),
                            dtype=torch.long)

    @property
    def sequence_mask(self) -> torch.Tensor:
        """(B, R) bool: every token of the response, sampled or inserted by the environment."""
        return self.response_mask if self.env_mask is None else self.response_mask | self.env_mask

    @property
    def costs(self) -> list[int]:
        """Tokens of each row's forward pass (prompt and whole response, environment tokens included): the cost that
        train.distributed.micro_batches packs by."""
        return [len(p) + int(n) for p, n in zip(self.prompt_ids, self.sequence_mask.sum(-1))]


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
        weights. Returns weight_sync/* (and the probe's rollout/*) metrics."""

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per-token log-probs of seqs[i][1:] given their prefixes (temperature 1), as the backend computes them."""

    def keep_prefixes(self) -> AbstractContextManager:
        """Within it, successive generate calls may reuse what earlier calls computed for the prompts they extend
        (multi-turn episodes: each turn's prompt is the episode so far); a no-op where the engine caches prefixes
        itself (vLLM)."""

    def close(self) -> None:
        """Release the engine (processes, memory, shared-memory slots)."""


def concat_rollouts(batches: list[Rollout]) -> Rollout:
    """The rows of several rollouts, in order, as one: response tensors right-padded to the longest (ids 0, mask
    False, log-probs 0 past a response's end: nothing reads them)."""
    R = max(b.response_ids.shape[1] for b in batches)

    def cat(name: str, value=0):
        return torch.cat([torch.nn.functional.pad(getattr(b, name), (0, R - getattr(b, name).shape[1]), value=value)
                          for b in batches])

    index = None if any(b.prompt_index is None for b in batches) else [i for b in batches for i in b.prompt_index]
    episodes = any(b.episodes is not None for b in batches)  # multi-turn: every batch is episodes
    episode, offset = [], 0
    for b in batches:
        episode += (b.row_episode() + offset).tolist()
        offset += len(b.first_rows())
    return Rollout([p for b in batches for p in b.prompt_ids], cat("response_ids"), cat("response_mask", False),
                   cat("sampling_logprobs"), torch.cat([b.truncated for b in batches]), index,
                   env_mask=cat("env_mask", False) if episodes else None,
                   env_reward=torch.cat([b.env_reward for b in batches]) if episodes else None,
                   episodes=[e for b in batches for e in b.episodes] if episodes else None,
                   episode=_numbered(episode))


def _numbered(episode: list[int]) -> list[int] | None:
    """Each row's episode renumbered 0.. in row order; None when every row is its own episode."""
    first = {e: n for n, e in enumerate(dict.fromkeys(episode))}
    out = [first[e] for e in episode]
    return None if out == list(range(len(out))) else out


def select_rows(ro: Rollout, rows: list[int]) -> Rollout:
    """The rollout of `rows` (indices into ro's responses), in that order."""
    ix = torch.tensor(rows, dtype=torch.long)
    return Rollout([ro.prompt_ids[i] for i in rows], ro.response_ids[ix], ro.response_mask[ix],
                   ro.sampling_logprobs[ix], ro.truncated[ix],
                   None if ro.prompt_index is None else [ro.prompt_index[i] for i in rows],
                   env_mask=None if ro.env_mask is None else ro.env_mask[ix],
                   env_reward=None if ro.env_reward is None else ro.env_reward[ix],
                   episodes=None if ro.episodes is None else [ro.episodes[i] for i in rows],
                   episode=None if ro.episode is None else _numbered([ro.episode[i] for i in rows]))


def episode_rows(ro: Rollout, episodes: list[int]) -> list[int]:
    """The rows of `episodes` (indices into ro's episodes), in that order."""
    of = ro.row_episode().tolist()
    rows: dict[int, list[int]] = {}
    for i, e in enumerate(of):
        rows.setdefault(e, []).append(i)
    return [i for e in episodes for i in rows[e]]


@dataclass
class Scores:
    """What a rollout's B responses scored (rewards.Rewards.of_rollout):
    total    (B,) float32           the sequence score the advantages use (weighted sum of the sources, penalties)
    sources  {name: (B,) float32}   each reward source's own scores, unweighted (the rewards/<name>/* metrics)
    """

    total: torch.Tensor
    sources: dict[str, torch.Tensor] = field(default_factory=dict)

    def select(self, rows: list[int]) -> Scores:
        """The scores of `rows`, in that order (as select_rows)."""
        ix = torch.tensor(rows, dtype=torch.long)
        return Scores(self.total[ix], {k: v[ix] for k, v in self.sources.items()})

    @staticmethod
    def concat(batches: list[Scores]) -> Scores:
        """The scores of several batches, in order, as one (as concat_rollouts)."""
        return Scores(torch.cat([b.total for b in batches]),
                      {k: torch.cat([b.sources[k] for b in batches]) for k in batches[0].sources})
