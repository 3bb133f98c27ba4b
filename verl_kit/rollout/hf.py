"""Rollout: prompts in; response token ids, response mask and sampling log-probs out.

Every backend implements rollout.types.RolloutBackend: `generate(prompts, params) -> Rollout`, `load_weights(actor,
version) -> dict` (the weight sync, called after every update with the optimizer step that produced the weights;
returns weight_sync/* metrics), `score(seqs)` and `close()`. `rollout.backends.make_backend` builds the one `--rollout`
names: HF generate (below), a vLLM engine (rollout.vllm_engine) or a vLLM server's client (rollout.vllm_client).

The HF-generate backend keeps a plain (unsharded, hook-free) copy of the policy on each process. Under ZeRO-3, calling
generate on the training engine would all-gather every layer's parameters again at every generated token; here they
are gathered once per update, parameter by parameter (`load_weights`), and generation then runs at plain-model speed
(measured in README). The price is one unsharded copy of the policy per process (in bf16 on GPU).
"""

from __future__ import annotations

import time

import torch

from verl_kit.models.lora import peft_model
from verl_kit.rollout.probe import trainer_logprobs
from verl_kit.rollout.types import Rollout, SamplingParams
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


class HFGenerateBackend:
    """Generation with transformers' `generate` on a plain copy of the policy (see the module docstring)."""

    BUCKET_BYTES = 64 << 20  # weight sync: parameters gathered at a time
    per_sample_seeds = False  # draws from the torch RNG (checkpointed with the run)

    def __init__(self, actor, tokenizer, device, dtype: torch.dtype):
        """`actor`: the unwrapped policy (a LoRA policy's copy is its base model class, the adapter merged in at each
        sync). The class is called directly on its config: from_config/from_pretrained would build ZeRO-3 shards
        whenever a ZeRO-3 config is registered with transformers."""
        plain = actor.get_base_model() if peft_model(actor) is not None else actor
        self.model = type(plain)(plain.config).to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.model.config.use_cache = True
        self.tokenizer, self.device = tokenizer, device
        self.load_weights(actor)

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
        for tensors, _ in gathered_buckets(actor, self.BUCKET_BYTES):
            for name, t in tensors.items():
                self.model.get_parameter(name).copy_(t)
        return {"weight_sync/seconds": time.time() - t0, "weight_sync/version": version}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        from transformers import GenerationConfig

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts_n = [p for p in prompts for _ in range(params.n)]
        P = max(len(p) for p in prompts_n)
        input_ids = torch.full((len(prompts_n), P), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts_n), P), dtype=torch.long)
        for i, p in enumerate(prompts_n):  # left padding: every response starts at column P
            input_ids[i, P - len(p):] = torch.tensor(p)
            attention[i, P - len(p):] = 1
        record = _RecordSampling(params, P)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else 0, eos_token_id=eos, pad_token_id=pad,
            repetition_penalty=1.0, use_cache=True)
        # synced_gpus=False: this copy is whole on every process, so generation is local. transformers would sync
        # every decoding step over all processes whenever a ZeRO-3 config is registered (as under a ZeRO-3 launch), and
        # then every process must call generate as often as the others: multi-turn episodes end after different
        # numbers of turns on different processes.
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  generation_config=config, logits_processor=[record], synced_gpus=False)
        response = out[:, P:].cpu()
        record.take(out[:, -1])
        logprobs = torch.stack(record.logprobs, 1).cpu()
        is_eos = response == eos
        ended = is_eos.long().cumsum(-1)
        mask = (ended == 0) | (is_eos & (ended == 1))  # up to and including the first EOS
        response = response.masked_fill(~mask, pad)
        return Rollout(prompts_n, response, mask, logprobs.masked_fill(~mask, 0.0), ~is_eos.any(-1))
