"""The run's sequence score: reward functions and an optional frozen reward model (an HF sequence classifier with its
own tokenizer and chat template), weighted and summed, with the missing-EOS penalty."""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from verl_kit.algos.advantages import truncation_penalty
from verl_kit.config import RewardConfig
from verl_kit.errors import UserError
from verl_kit.models.loading import pretrained, resolve_model_path
from verl_kit.rewards.functions import CallLimits, call_reward_fn, load_reward_fn, nonfinite_score, reward_columns
from verl_kit.rewards.remote import RemoteRewardModel, RewardServerError
from verl_kit.rollout.types import Scores, select_rows
from verl_kit.train.distributed import reduce_metrics
from verl_kit.train.trainable import frozen

logger = logging.getLogger(__name__)


def weighted_sum(scores: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_k w_k * s_k over reward sources; each s_k (B,) -> (B,)."""
    return sum(w * s for w, s in zip(weights, scores))


class Rewards:
    """The run's sequence score: the reward functions (`specs`, comma-separated) and the optional reward model,
    weighted (`weights`, comma-separated, in that order; default all 1) and summed, plus `missing_eos_penalty` for
    responses cut at max length. Bad weights are a one-line UserError naming the flags. `limits`: the reward
    functions' timeout, concurrency and fallback (CallLimits), and their counts (metrics())."""

    def __init__(self, specs: str | None, reward_model: RewardModel | None, weights: str | None,
                 missing_eos_penalty: float = 0.0, tokenizer=None, limits: CallLimits | None = None,
                 env_reward: bool = False):
        self.fns = [(s, load_reward_fn(s)) for s in (specs or "").split(",") if s.strip() not in ("", "none")]
        names = [getattr(fn, "__name__", s) for s, fn in self.fns]  # TRL's rewards/<name>/* metric names
        names += [os.path.basename(reward_model.name.rstrip("/"))] if reward_model else []
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.limits = limits or CallLimits()
        self.reward_model, self.missing_eos_penalty = reward_model, missing_eos_penalty
        self.unscored: str | None = None  # the last batch's source that scored every response --reward_fallback
        self.tokenizer = tokenizer  # the policy's: of_rollout decodes responses with it
        n = len(self.fns) + bool(reward_model)
        try:
            self.weights = [float(w) for w in weights.split(",")] if weights else [1.0] * n
        except ValueError:
            raise UserError(f"--reward_weights {weights!r}: expected comma-separated numbers") from None
        if not all(math.isfinite(w) for w in self.weights):
            raise UserError(f"--reward_weights {weights!r}: expected finite numbers")
        if (n == 0 and not env_reward) or len(self.weights) != n:  # env_reward: an environment's get_reward
            raise UserError(f"--reward_weights: {len(self.weights)} weight(s) for {n} reward source(s) "
                            "(--reward_fn entries, then --reward_model_name_or_path or --reward_model_url)")

    def sources(self, prompts: list, completions: list[str], columns: dict[str, list] | None = None, *,
                completion_ids: list | None = None) -> dict[str, torch.Tensor]:
        """Each source's own scores (B,), unweighted, by name (`names`: the reward function's __name__, the reward
        model's directory name), in --reward_weights order. A source that scored every response --reward_fallback
        is named in `unscored` (what the last one said), which of_rollout hands on as Scores.failure."""
        scores, self.unscored = [], None
        for spec, fn in self.fns:
            with self._watch(len(completions)):
                scores.append(call_reward_fn(spec, fn, prompts, completions, columns, completion_ids, self.limits))
        if self.reward_model:  # a non-finite score: --reward_fallback, or one line naming the model and the sample
            with self._watch(len(completions)):
                scores.append(torch.tensor([nonfinite_score(f"reward model {self.names[-1]}", v, self.limits, p, c, i)
                                            for i, (v, p, c) in enumerate(zip(
                                                self.model_scores(prompts, completions), prompts, completions))],
                                           dtype=torch.float32))
        return dict(zip(self.names, scores))

    @contextlib.contextmanager
    def _watch(self, n: int):
        """Around one source's scoring of n responses: when all n got the fallback, `unscored` says why."""
        before = self.limits.fallbacks
        yield
        if n and self.limits.fallbacks - before >= n:
            self.unscored = self.unscored or self.limits.last_failure

    def model_scores(self, prompts: list, completions: list[str]) -> list[float]:
        """The reward model's scores; a served one's failed request (rewards.remote.RewardServerError) scores every
        sample of the batch --reward_fallback, counted, or stops the run in one line naming the server."""
        try:
            return self.reward_model.score(prompts, completions).tolist()
        except RewardServerError as e:
            if self.limits.fallback is None:
                raise UserError(f"reward model at {self.reward_model.url}: {e}; pass --reward_fallback <score> to "
                                "score such batches and go on") from None
            logger.warning("reward model at %s: %s; %d samples scored --reward_fallback %g", self.reward_model.url, e,
                           len(completions), self.limits.fallback)
            if e.timed_out:
                self.limits.timeouts += len(completions)
            else:
                self.limits.errors += len(completions)
            self.limits.last_failure = f"reward model at {self.reward_model.url}: {e}"
            return [self.limits.fallback] * len(completions)

    def total(self, sources: dict[str, torch.Tensor], truncated: torch.Tensor) -> torch.Tensor:
        """The weighted sum of `sources` (B,), with the missing-EOS penalty on the `truncated` responses."""
        total = weighted_sum(list(sources.values()), self.weights) if sources else torch.zeros(len(truncated))
        return truncation_penalty(total, truncated, self.missing_eos_penalty)

    def metrics(self) -> dict[str, float]:
        """reward/timeouts and reward/errors: the responses scored by --reward_fallback since the run (or its resume)
        started (a call that timed out; one that raised or a non-finite score, of any source), summed over processes
        (a collective: every process calls it at the same point)."""
        return reduce_metrics({"reward/timeouts": self.limits.timeouts, "reward/errors": self.limits.errors})

    def of_rollout(self, rollout) -> Scores:
        """The Scores of a rollout.Rollout's responses, decoded with the policy's tokenizer (special tokens dropped;
        `tokenizer`, set by make_rewards): the weighted total (B,) and each source's own scores (the environment's
        get_reward() as `environment`, added with weight 1 as TRL does). Each response is scored against its dataset
        row (`rollout.rows`: its `prompt` field, and the other columns the reward functions may read). The reward
        functions may also take `completion_ids` (the responses' token ids). Nothing non-finite comes out: a source's
        NaN or inf score, or a weighted total that overflows, is --reward_fallback (counted in reward/errors) or a
        one-line UserError naming the source and the sample. An agent's episode of several rows (rollout.agents:
        per-call samples) is scored once, on its last row (its final call), and every row of it gets that score."""
        if rollout.rows is None:
            raise ValueError("Rewards.of_rollout: the rollout carries no dataset rows (Rollout.rows)")
        if rollout.episode is not None:
            last = rollout.last_rows()
            return self.of_rollout(select_rows(rollout, last)).select(rollout.row_episode().tolist())
        rows = rollout.rows
        ids = [r[m] for r, m in zip(rollout.response_ids, rollout.response_mask)]
        completions = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        prompts = [r["prompt"] for r in rows]
        sources = self.sources(prompts, completions, reward_columns(rows), completion_ids=[x.tolist() for x in ids])
        total = self.total(sources, rollout.truncated)
        if rollout.env_reward is not None:  # multi-turn: get_reward() (an agent's return value) is one more source
            name = rollout.episodes[0].get("reward_source", "environment") if rollout.episodes else "environment"
            sources[name] = self.environment(rollout, prompts, completions)
            total = total + sources[name]
        total = torch.tensor([nonfinite_score("the weighted reward total", v, self.limits, p, c, i)
                              for i, (v, p, c) in enumerate(zip(total.tolist(), prompts, completions))])
        return Scores(total, sources, failure=self.unscored)

    def environment(self, rollout, prompts: list, completions: list[str]) -> torch.Tensor:
        """Each episode's get_reward() (B,): where it raised (rollout.episodes[i]["reward_error"], counted in
        episode/env_errors) --reward_fallback, counted in reward/errors, or 0 without one (an environment without
        get_reward adds 0); a non-finite value the fallback or a one-line UserError naming the environment."""
        out = rollout.env_reward.clone()
        for i, v in enumerate(out.tolist()):
            info = rollout.episodes[i] if rollout.episodes else {}
            if info.get("reward_error"):
                self.limits.errors += self.limits.fallback is not None
                out[i] = self.limits.fallback if self.limits.fallback is not None else 0.0
            elif not math.isfinite(v):
                source = f"environment {info['env_class']}.get_reward()" if info.get("env_class") else "get_reward()"
                out[i] = nonfinite_score(source, v, self.limits, prompts[i], completions[i], i)
        return out


class RewardModel:
    """A frozen HF sequence-classification model (num_labels=1) with its own tokenizer. `model` may be a ZeRO-3
    inference engine (see train.trainable.frozen): every process must then call score() the same number of times
    with the same number of samples."""

    def __init__(self, model, tokenizer, device, max_length: int = 1024, batch_size: int = 16):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.name = getattr(getattr(model, "module", model).config, "_name_or_path", "") or "reward_model"
        self.max_length, self.batch_size = max_length, batch_size

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        """Prompt + completion rendered for the reward model: chat messages go through its chat template."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list) and self.tokenizer.chat_template is not None:
                out.append(self.tokenizer.apply_chat_template(
                    prompt + [{"role": "assistant", "content": completion}], tokenize=False))
            elif isinstance(prompt, list):
                out.append("\n".join(m["content"] for m in prompt) + "\n" + completion)
            else:
                out.append(prompt + completion)
        return out

    @torch.no_grad()
    def score(self, prompts: list, completions: list[str]) -> torch.Tensor:
        """(B,) scores. Batches are formed from texts of similar length (sorted), so little of a forward pass is
        padding; the batch count depends only on B (ZeRO-3 lockstep)."""
        ids = self.tokenizer(self.texts(prompts, completions), add_special_tokens=False, truncation=True,
                             max_length=self.max_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.zeros(len(ids), dtype=torch.float32)
        for i in range(0, len(order), self.batch_size):
            rows = order[i:i + self.batch_size]
            enc = self.tokenizer.pad({"input_ids": [ids[j] for j in rows]}, return_tensors="pt")
            logits = self.model(input_ids=enc["input_ids"].to(self.device),
                                attention_mask=enc["attention_mask"].to(self.device)).logits
            out[rows] = logits[:, 0].float().cpu()
        return out


def make_rewards(cfg: RewardConfig, accelerator, tokenizer, max_length: int, batch_size: int,
                 env_reward: bool = False) -> Rewards:
    """The run's Rewards from its RewardConfig: `--reward_fn`, `--reward_model_name_or_path` (placed frozen: a ZeRO-3
    inference engine under ZeRO-3; it reads `max_length` tokens, `batch_size` responses per forward) or
    `--reward_model_url` (served: rewards.remote.RemoteRewardModel),
    `--reward_weights`, `--missing_eos_penalty`, `--reward_timeout_s`, `--reward_max_concurrency`,
    `--reward_fallback`; `env_reward`: an environment's get_reward() adds to the score."""
    reward_model = None
    if cfg.reward_model_url:
        reward_model = RemoteRewardModel(cfg.reward_model_url, ca_file=cfg.reward_model_ca_file,
                                         timeout_s=cfg.reward_timeout_s)
    elif cfg.reward_model_name_or_path:
        reward_model = load_reward_model(cfg.reward_model_name_or_path, lambda load: frozen(accelerator, load),
                                         accelerator.device, max_length, batch_size)
    limits = CallLimits(cfg.reward_timeout_s, cfg.reward_fallback, cfg.reward_max_concurrency)
    return Rewards(cfg.reward_fn, reward_model, cfg.reward_weights, cfg.missing_eos_penalty, tokenizer, limits,
                   env_reward=env_reward)


def load_reward_model(path: str, load_frozen, device, max_length: int, batch_size: int) -> RewardModel:
    """A RewardModel from a local directory or hub id; `load_frozen(loader)` places it (train.trainable.frozen)."""
    path = resolve_model_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_frozen(lambda: pretrained(AutoModelForSequenceClassification, path, num_labels=1,
                                           dtype=torch.float32))
    config = getattr(model, "module", model).config
    if config.pad_token_id is None:  # the score is read at the last non-pad token
        config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer, device, max_length, batch_size)
