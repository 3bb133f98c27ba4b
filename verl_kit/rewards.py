"""Rewards: sequence scores (B,) for the decoded responses, from Python functions and/or a reward model.

Reward functions have the signature `fn(prompts, completions) -> list[float]`: `prompts` are the dataset's prompt
fields as they are (a string or chat messages), `completions` the decoded responses (special tokens removed). They are
named on the command line as `module:function` or `path/to/file.py:function`. A reward model is an HF
sequence-classification model with its *own* tokenizer: the policy's text is decoded and re-tokenized with the reward
tokenizer and its chat template, so policy and reward model need not share a vocabulary.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re

import torch

from verl_kit.advantages import truncation_penalty
from verl_kit.errors import UserError
from verl_kit.tiny import GOOD


def kind_words(prompts, completions) -> list[float]:
    """The embedded task: the share of a response's words that are kind adjectives (verl_kit.tiny.GOOD)."""
    out = []
    for text in completions:
        words = re.findall(r"[a-z]+", text.lower())
        out.append(sum(w in GOOD for w in words) / max(len(words), 1))
    return out


def load_reward_fn(spec: str):
    """'package.module:function' or 'path/to/file.py:function' -> the function."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise UserError(f"--reward_fn {spec!r}: expected module:function or path/to/file.py:function")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise UserError(f"--reward_fn {spec!r}: no such file {target}")
        module_spec = importlib.util.spec_from_file_location(f"reward_fn_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"--reward_fn {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"--reward_fn {spec!r}: cannot import module {target!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--reward_fn {spec!r}: {target} has no function {name!r}")
    return fn


def _excerpt(x, n: int = 60) -> str:
    text = x if isinstance(x, str) else str(x)
    return repr(text[:n] + ("..." if len(text) > n else ""))


def call_reward_fn(name: str, fn, prompts: list, completions: list[str]) -> torch.Tensor:
    """Run one reward function and check what it returns: (B,) float32. An exception, a result of the wrong length,
    or a non-finite or non-numeric value raises UserError naming the function and the sample (index and prompt).
    When the batch call raises, the samples are retried one by one to find the one that fails."""
    try:
        values = list(fn(prompts, completions))
    except Exception as e:
        for i in range(len(completions)):
            try:
                fn(prompts[i:i + 1], completions[i:i + 1])
            except Exception as e1:
                raise UserError(f"reward function {name} raised {type(e1).__name__}: {e1} on sample {i} "
                                f"(prompt {_excerpt(prompts[i])}, completion {_excerpt(completions[i])})") from None
        raise UserError(f"reward function {name} raised {type(e).__name__}: {e} on a batch of "
                        f"{len(completions)} samples (each alone passes)") from None
    if len(values) != len(completions):
        raise UserError(f"reward function {name} returned {len(values)} values for {len(completions)} samples")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"reward function {name} returned {v!r} for sample {i} (prompt {_excerpt(prompts[i])}, "
                            f"completion {_excerpt(completions[i])}); expected a finite number")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def weighted_sum(scores: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_k w_k * s_k over reward sources; each s_k (B,) -> (B,)."""
    return sum(w * s for w, s in zip(weights, scores))


class Rewards:
    """The run's sequence score: the reward functions (`specs`, comma-separated) and the optional reward model,
    weighted (`weights`, comma-separated, in that order; default all 1) and summed, plus `missing_eos_penalty` for
    responses cut at max length. Bad weights are a one-line UserError naming the flags."""

    def __init__(self, specs: str | None, reward_model: RewardModel | None, weights: str | None,
                 missing_eos_penalty: float = 0.0):
        self.fns = [(s, load_reward_fn(s)) for s in (specs or "").split(",") if s.strip() not in ("", "none")]
        self.reward_model, self.missing_eos_penalty = reward_model, missing_eos_penalty
        n = len(self.fns) + bool(reward_model)
        try:
            self.weights = [float(w) for w in weights.split(",")] if weights else [1.0] * n
        except ValueError:
            raise UserError(f"--reward_weights {weights!r}: expected comma-separated numbers") from None
        if n == 0 or len(self.weights) != n:
            raise UserError(f"--reward_weights: {len(self.weights)} weight(s) for {n} reward source(s) "
                            "(--reward_fn entries, then --reward_model_name_or_path)")

    def __call__(self, prompts: list, completions: list[str], truncated: torch.Tensor) -> torch.Tensor:
        sources = [call_reward_fn(name, fn, prompts, completions) for name, fn in self.fns]
        sources += [self.reward_model.score(prompts, completions)] if self.reward_model else []
        return truncation_penalty(weighted_sum(sources, self.weights), truncated, self.missing_eos_penalty)

    def of_rollout(self, prompts: list, rollout, tokenizer) -> torch.Tensor:
        """Scores (B,) of a rollout.Rollout's responses, decoded with the policy's `tokenizer` (special tokens
        dropped); `prompts` are the dataset's prompt fields, one per response."""
        completions = tokenizer.batch_decode([r[m] for r, m in zip(rollout.response_ids, rollout.response_mask)],
                                             skip_special_tokens=True)
        return self(prompts, completions, rollout.truncated)


class RewardModel:
    """A frozen HF sequence-classification model (num_labels=1) with its own tokenizer. `model` may be a ZeRO-3
    inference engine (see actor_critic.frozen): every process must then call score() the same number of times
    with the same number of samples."""

    def __init__(self, model, tokenizer, device, max_length: int = 1024, batch_size: int = 16):
        self.model, self.tokenizer, self.device = model, tokenizer, device
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


def load_reward_model(path: str, load_frozen, device, max_length: int, batch_size: int) -> RewardModel:
    """A RewardModel from a local directory or hub id; `load_frozen(loader)` places it (actor_critic.frozen)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl_kit.models import resolve_model_path

    path = resolve_model_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_frozen(lambda: AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                                                  dtype=torch.float32))
    config = getattr(model, "module", model).config
    if config.pad_token_id is None:  # the score is read at the last non-pad token
        config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer, device, max_length, batch_size)
