"""Rollout: prompts in; response token ids, response mask and sampling log-probs out.

Every backend implements rollout.types.RolloutBackend: `generate(prompts, params) -> Rollout`, `load_weights(actor,
version) -> dict` (the weight sync, called after every update with the optimizer step that produced the weights;
returns sync/* metrics), `score(seqs)` and `close()`. `rollout.backends.make_backend` builds the one `--rollout`
names: HF generate (below), a vLLM engine (rollout.vllm_engine) or a vLLM server's client (rollout.vllm_client).

The HF-generate backend keeps a plain (unsharded, hook-free) copy of the policy on each process. Under ZeRO-3, calling
generate on the training engine would all-gather every layer's parameters again at every generated token; here they
are gathered once per update, parameter by parameter (`load_weights`), and generation then runs at plain-model speed
(about 4x faster than on the ZeRO-3 engine for the 20M bench model on 2 processes, docs/rollouts.md). The price is
one unsharded copy of the policy per process (in bf16 on GPU). Where the trained model already is that plain model
(`shares_policy`: one process, no sharding, no LoRA adapter to merge, the same dtype, and no --async_rollout, which
generates while the model is updated) the backend generates on it instead, in eval mode, and a sync has nothing to
copy: the same tokens, one copy of the weights less (SmolLM2: 0.5 GiB).

Multi-turn episodes (rollout.episodes) generate each turn from the whole episode so far. Inside `keep_prefixes()`
the backend keeps each call's KV cache, and a call whose prompts extend rows of the previous call (the next turn)
prefills only each row's new tokens (the environment's reply, the last turn's EOS): the cached columns stay where
they are, the finished rows' padding is masked out, and the new tokens enter as a left-padded block after them
(positions come from the attention mask, so the holes do not shift them). The same mechanism serves a group's
samples, which share their prompt: each distinct prompt is prefilled once and its cache repeated for its samples
(generate alone would prefill every sample). A vLLM engine caches prefixes itself.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from verl_kit.models.lora import peft_model
from verl_kit.rollout.probe import trainer_logprobs
from verl_kit.rollout.types import Prompts, Rollout, SamplingParams
from verl_kit.rollout.weight_sync import gathered_buckets


class _RecordSampling:
    """Logits processor that applies temperature, top-k and top-p itself (generate is told to apply none) and keeps
    the log-softmax of the result for one step, so the log-prob of each sampled token is read at the next step, or
    after generation for the last one, without storing a (steps, B, V) tensor of scores."""

    def __init__(self, params: SamplingParams, prompt_len: int):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
        warpers += [TopKLogitsWarper(params.top_k)] if params.top_k > 0 else []
        warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
        self.warp = LogitsProcessorList(warpers)
        self.prompt_len = prompt_len
        self.last = None
        self.logprobs: list[torch.Tensor] = []

    def take(self, tokens: torch.Tensor) -> None:
        self.logprobs.append(self.last.gather(-1, tokens[:, None]).squeeze(-1).float())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            self.take(input_ids[:, -1])
        scores = self.warp(input_ids, scores)
        self.last = scores.float().log_softmax(-1)
        return scores


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids and attention mask, left-padded: every response starts at column P."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


@dataclass
class _Kept:
    """The last call's batch, kept for the next turn: each row's tokens (prompt and response up to its EOS), the
    (B, W) token and attention columns, and the KV cache of the first W - 1 columns (the last sampled token has none
    yet)."""

    rows: list[list[int]]
    ids: torch.Tensor
    mask: torch.Tensor
    cache: object

    def extend(self, prompts: list[list[int]], pad: int):
        """(input_ids, attention_mask, cache) for `prompts` if each extends a kept row by at least one token, else
        None (the caller prefills from scratch)."""
        C = self.cache.get_seq_length()
        by_tokens = {tuple(r): i for i, r in enumerate(self.rows)}
        lengths = sorted({len(r) for r in self.rows})
        picked, tails = [], []
        for p in prompts:
            i = next((by_tokens[k] for n in lengths if (k := tuple(p[:n])) in by_tokens), None)
            if i is None:
                return None
            tail = p[int(self.mask[i, :C].sum()):]  # what the cache holds of row i is its first tokens, in order
            if not tail:
                return None
            picked.append(i)
            tails.append(tail)
        block, block_mask = _left_pad(tails, pad)  # every response starts at column C + S
        ix = torch.tensor(picked)
        self.cache.batch_select_indices(ix.to(self.cache.layers[0].keys.device))
        return (torch.cat([self.ids[ix, :C], block], 1), torch.cat([self.mask[ix, :C], block_mask], 1), self.cache)


def shares_policy(whole: bool, lora: bool, bf16: bool, async_rollout: bool) -> bool:
    """Whether the HF backend generates on the trained model itself rather than a copy (the module docstring): the
    model `whole` in this process (Sharding.whole: one process, no sharding), no LoRA, fp32 (a bf16 run generates in
    bf16 from fp32 weights), no --async_rollout."""
    return whole and not lora and not bf16 and not async_rollout


class HFGenerateBackend:
    """Generation with transformers' `generate` on a plain copy of the policy (see the module docstring)."""

    BUCKET_BYTES = 64 << 20  # weight sync: parameters gathered at a time
    per_sample_seeds = False  # draws from the torch RNG (checkpointed with the run)

    def __init__(self, actor, tokenizer, device, dtype: torch.dtype, sharding=None, share: bool = False):
        """`actor`: the unwrapped policy (a LoRA policy's copy is its base model class, the adapter merged in at each
        sync), placed by `sharding` (the run's train.Sharding, which gathers its full tensors; None: they are whole).
        The class is called directly on its config: from_config/from_pretrained would build ZeRO-3 shards whenever a
        ZeRO-3 config is registered with transformers. `share`: generate on `actor` itself (shares_policy)."""
        self.shared = share
        if share:
            self.model = actor
        else:
            plain = actor.get_base_model() if peft_model(actor) is not None else actor
            self.model = type(plain)(plain.config).to(device=device, dtype=dtype).eval().requires_grad_(False)
            self.model.config.use_cache = True
        self.tokenizer, self.device, self.sharding = tokenizer, device, sharding
        self._keeping, self._kept = False, None
        self.load_weights(actor)

    @contextlib.contextmanager
    def _inference(self):
        """Eval mode for a generation (a shared policy is in training mode between them: no dropout, and transformers
        drops the KV cache of a gradient-checkpointed model in training mode), restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def keep_prefixes(self):
        """Within it, every call keeps its KV cache for the next, which prefills only what its prompts add to the
        previous call's rows (see the module docstring); the cache is dropped on exit and at every weight sync."""
        self._keeping = True
        try:
            yield
        finally:
            self._keeping, self._kept = False, None

    def close(self) -> None:
        """Nothing to release (the vLLM backends stop their engine or server here)."""

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Log-probs of seqs[i][1:] given their prefixes under the rollout copy (temperature 1)."""
        return trainer_logprobs(self.model, seqs, self.device)

    @torch.no_grad()
    def load_weights(self, actor, version: int = 0) -> dict:
        """Weight sync: copy the (unwrapped) actor's parameters, as the vLLM sync sends them (gathered in buckets
        under ZeRO-3, a LoRA adapter merged). Collective: every process calls it, at the same point. `version`: the
        optimizer step that produced the weights."""
        t0 = time.time()
        self._kept = None  # computed with the old weights
        if self.shared:  # generation reads the trained weights themselves
            return {"sync/seconds": time.time() - t0, "sync/version": version}
        for tensors, _ in gathered_buckets(actor, self.BUCKET_BYTES, self.sharding):
            for name, t in tensors.items():
                self.model.get_parameter(name).copy_(t)
        return {"sync/seconds": time.time() - t0, "sync/version": version}

    def _prefill_once(self, distinct: list[list[int]], pad: int) -> _Kept | None:
        """The KV cache of each distinct prompt but its last token, computed once (generate would prefill every
        sample of a prompt again); the call then extends it by that token per sample. None where it cannot help."""
        from transformers import DynamicCache

        ids, mask = _left_pad(distinct, pad)
        if ids.shape[1] < 2:
            return None
        cache = DynamicCache(config=self.model.config)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        self.model(input_ids=ids[:, :-1].to(self.device), attention_mask=mask[:, :-1].to(self.device),
                   position_ids=position[:, :-1].to(self.device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        return _Kept(distinct, ids, mask, cache) if _plain_layers(cache) else None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        from transformers import GenerationConfig

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts_n = Prompts.each(prompts, params.n)
        kept, self._kept = self._kept, None
        distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts_n))] if kept is None else prompts_n
        if len(distinct) < len(prompts_n):
            with self._inference():
                kept = self._prefill_once(distinct, pad)  # a group's samples share their prompt: prefill it once
        extended = kept.extend(prompts_n, pad) if kept is not None else None
        if extended is not None:
            input_ids, attention, cache = extended
        else:
            (input_ids, attention), cache = _left_pad(prompts_n, pad), None
        P = input_ids.shape[1]
        record = _RecordSampling(params, P)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else 0, eos_token_id=eos, pad_token_id=pad,
            repetition_penalty=1.0, use_cache=True, return_dict_in_generate=True)
        # synced_gpus=False: this copy is whole on every process, so generation is local. transformers would sync
        # every decoding step over all processes whenever a ZeRO-3 config is registered (as under a ZeRO-3 launch), and
        # then every process must call generate as often as the others: multi-turn episodes end after different
        # numbers of turns on different processes.
        with self._inference():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      past_key_values=cache, generation_config=config, logits_processor=[record],
                                      synced_gpus=False)
        out, cache = out.sequences, out.past_key_values
        response = out[:, P:].cpu()
        record.take(out[:, -1])
        logprobs = torch.stack(record.logprobs, 1).cpu()
        is_eos = response == eos
        ended = is_eos.long().cumsum(-1)
        mask = (ended == 0) | (is_eos & (ended == 1))  # up to and including the first EOS
        response = response.masked_fill(~mask, pad)
        if self._keeping and _plain_layers(cache):
            self._kept = _Kept([p + r[m].tolist() for p, r, m in zip(prompts_n, response, mask)], out.cpu(),
                               torch.cat([attention, mask.long()], 1), cache)
        return Rollout(prompts_n, response, mask, logprobs.masked_fill(~mask, 0.0), ~is_eos.any(-1))


def _plain_layers(cache) -> bool:
    """Whether every layer of `cache` keeps every column (a sliding window or a linear-attention state cannot be
    extended past masked columns this way)."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))
