"""Rollout: prompts in; response token ids, response mask and sampling log-probs out.

A backend has three methods: `load_weights(actor, version) -> dict` (the weight sync, called after every update with
the optimizer step that produced the weights; returns weight_sync/* metrics), `generate(prompts, params) -> Rollout`
and `close()`. `make_backend` builds the one `--rollout` names: HF generate (below), or a vLLM engine or server
(verl_kit.vllm_rollout).

The HF-generate backend keeps a plain (unsharded, hook-free) copy of the policy on each process. Under ZeRO-3, calling
generate on the training engine would all-gather every layer's parameters again at every generated token; here they
are gathered once per update, parameter by parameter (`load_weights`), and generation then runs at plain-model speed
(measured in README). The price is one unsharded copy of the policy per process (in bf16 on GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from verl_kit.errors import UserError


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


@dataclass
class Rollout:
    """B = len(prompts) * n responses; prompt i's samples are rows i*n .. i*n + n - 1.

    prompt_ids         list of B token-id lists   the prompt of each response (unpadded, for packing)
    response_ids       (B, R) long                sampled tokens, pad after the end (the EOS is kept)
    response_mask      (B, R) bool                True on response tokens up to and including the EOS
    sampling_logprobs  (B, R) float32             log-prob of each token under the sampling distribution
                                                  (temperature, top-k, top-p applied), 0 outside the mask
    truncated          (B,) bool                  no EOS within max_new_tokens
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampling_logprobs: torch.Tensor
    truncated: torch.Tensor


@dataclass
class Prompts:
    """A split of prompts: the dataset `rows` (dicts: `prompt` and the other columns the rewards may read) and their
    token `ids` (the prompt rendered with the chat template, truncated)."""

    rows: list[dict]
    ids: list[list[int]]


def load_prompt_splits(cfg, tokenizer) -> tuple[Prompts, Prompts]:
    """The train and held-out prompts of a recipe config (the held-out set is empty without a test split)."""
    from verl_kit.data import load_splits

    train_ds, test_ds = load_splits(cfg)
    splits = []
    for ds, source in ((train_ds, cfg.dataset_name), (test_ds, f"{cfg.dataset_name}[{cfg.dataset_test_split}]")):
        rows = list(ds) if ds is not None else []
        splits.append(Prompts(rows, load_prompts(rows, tokenizer, cfg.max_prompt_length, source)))
    return splits[0], splits[1]


def rollout_metrics(ro: Rollout, scores: torch.Tensor, step_seconds: float) -> dict:
    """reward/*, response_length/* and perf/tokens_per_s of a step's rollouts on all processes (collective)."""
    from verl_kit.distributed import reduce_metrics

    lengths = ro.response_mask.sum(-1)
    t = reduce_metrics({"n": len(scores), "score": scores.sum(), "score_sq": (scores ** 2).sum(),
                        "tokens": lengths.sum(), "truncated": ro.truncated.sum(),
                        "prompt_tokens": sum(len(p) for p in ro.prompt_ids)}, {"max_length": lengths.max()})
    n, mean = t["n"], t["score"] / t["n"]
    return {"reward/mean": mean, "reward/std": max(t["score_sq"] / n - mean ** 2, 0.0) ** 0.5,
            "response_length/mean": t["tokens"] / n, "response_length/max": t["max_length"],
            "response_length/clip_ratio": t["truncated"] / n,
            "perf/tokens_per_s": (t["tokens"] + t["prompt_tokens"]) / step_seconds}


def load_prompts(ds, tokenizer, max_prompt_length: int, source: str) -> list[list[int]]:
    """Token ids of each row's `prompt` (a string, or chat messages rendered with the generation prompt); prompts
    longer than max_prompt_length keep their last tokens."""
    out = []
    for row_no, row in enumerate(ds, start=1):
        prompt = row.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        elif isinstance(prompt, str) and prompt.strip():
            text = prompt
        else:
            raise UserError(f"{source} row {row_no}: field 'prompt' must be a non-empty string or chat messages")
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_length:])
    return out


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

    def __init__(self, actor, tokenizer, device, dtype: torch.dtype):
        """`actor`: the unwrapped policy (a LoRA policy's copy is its base model class, the adapter merged in at each
        sync). The class is called directly on its config: from_config/from_pretrained would build ZeRO-3 shards
        whenever a ZeRO-3 config is registered with transformers."""
        from verl_kit.lora import peft_model

        plain = actor.get_base_model() if peft_model(actor) is not None else actor
        self.model = type(plain)(plain.config).to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.model.config.use_cache = True
        self.tokenizer, self.device = tokenizer, device
        self.load_weights(actor)

    def close(self) -> None:
        """Nothing to release (the vLLM backends stop their engine or server here)."""

    @torch.no_grad()
    def load_weights(self, actor, version: int = 0) -> dict:
        """Weight sync: copy the (unwrapped) actor's parameters, as the vLLM sync sends them (gathered in buckets
        under ZeRO-3, a LoRA adapter merged). Collective: every process calls it, at the same point. `version`: the
        optimizer step that produced the weights."""
        from verl_kit.weight_sync import gathered_buckets

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
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  generation_config=config, logits_processor=[record])
        response = out[:, P:].cpu()
        record.take(out[:, -1])
        logprobs = torch.stack(record.logprobs, 1).cpu()
        is_eos = response == eos
        ended = is_eos.long().cumsum(-1)
        mask = (ended == 0) | (is_eos & (ended == 1))  # up to and including the first EOS
        response = response.masked_fill(~mask, pad)
        return Rollout(prompts_n, response, mask, logprobs.masked_fill(~mask, 0.0), ~is_eos.any(-1))


@torch.no_grad()
def evaluate(accelerator, engine, prompts: list[list[int]], raw_prompts: list, params: SamplingParams, score,
             batch_size: int) -> dict:
    """Mean score of the responses to held-out prompts (`score(raw_prompts, rollout) -> (B,)`, no KL term), the
    prompts sharded over processes, `batch_size` per generate call. Every process makes the same calls (ZeRO-3
    lockstep). The torch RNG is forked, so a run samples the same training rollouts with or without evaluation. With
    `params.seed`, every response gets its own seed (the seed plus its prompt's position)."""
    from verl_kit.distributed import Tally, shard
    from verl_kit.metrics import progress

    world, rank, n = accelerator.num_processes, accelerator.process_index, len(prompts)
    mine = shard(n, rank, world)
    tally = Tally()
    starts = range(0, len(mine), batch_size)
    with torch.random.fork_rng():
        for i in progress(starts, "eval", len(starts), accelerator.is_main_process):
            idx = mine[i:i + batch_size]
            first = (rank + world * i) * params.n  # this batch's first response, over all processes
            ro = engine.generate([prompts[j] for j in idx],
                                 params if params.seed is None else replace(params, seed=params.seed + first))
            scores = score([raw_prompts[j] for j in idx for _ in range(params.n)], ro).view(len(idx), params.n)
            real = torch.tensor([rank + world * (i + k) < n for k in range(len(idx))])  # not shard()'s wrap-around
            tally.add(responses=float(real.sum()) * params.n, score=scores[real],
                      tokens=ro.response_mask.view(len(idx), params.n, -1)[real])
    t = tally.reduce()
    return {"eval/reward_mean": t["score"] / t["responses"], "eval/response_length": t["tokens"] / t["responses"]}


def sample_rows(step: int, rows: list[dict], ro: Rollout, scores: torch.Tensor, tokenizer, k: int = 4) -> list[dict]:
    """k of a step's responses, spread over its prompts, as readable rows for samples.jsonl: step, prompt (as in the
    dataset), completion (decoded), reward, and the row's other columns as `reference`."""
    out = []
    for i in range(0, len(rows), max(1, len(rows) // k))[:k]:
        text = tokenizer.decode(ro.response_ids[i][ro.response_mask[i]], skip_special_tokens=True)
        out.append({"step": step, "prompt": rows[i]["prompt"], "completion": text, "reward": float(scores[i]),
                    "reference": {c: v for c, v in rows[i].items() if c != "prompt"}})
    return out


def make_backend(cfg, accelerator, actor, model_path: str, tokenizer, probe_prompts: list[list[int]]):
    """The `--rollout` backend (OnlineConfig flags) for the unwrapped `actor`, in bf16 when training is: HF generate
    on a plain copy, a vLLM engine in each process, or a vLLM server. Collective for vllm-server without a URL:
    process 0 starts a server on a free 127.0.0.1 port (stopped at exit, or when this process dies) and every process
    connects to it; only process 0 pushes weights to it."""
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    if cfg.rollout == "hf":
        return HFGenerateBackend(actor, tokenizer, accelerator.device, dtype)
    from verl_kit.vllm_rollout import VLLMColocated, VLLMServer

    rank, world = accelerator.process_index, accelerator.num_processes
    vllm_dtype = str(dtype).removeprefix("torch.")
    common = dict(bucket_mb=cfg.vllm_sync_bucket_mb, sync_timeout_s=cfg.vllm_sync_timeout_s,
                  probe_prompts=probe_prompts, probe_threshold=cfg.vllm_probe_threshold)
    if cfg.rollout == "vllm":
        return VLLMColocated(model_path, tokenizer, dtype=vllm_dtype, seed=cfg.seed + rank,
                             max_model_len=cfg.max_length, tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                             max_num_seqs=cfg.vllm_max_num_seqs,
                             gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                             enable_sleep_mode=cfg.vllm_enable_sleep_mode, kv_cache_gib=cfg.vllm_kv_cache_gib,
                             **common)
    server, url = None, cfg.vllm_server_url
    if not url:
        if rank == 0:
            import atexit

            from verl_kit.vllm_server import ServerProcess

            server = ServerProcess(model_path, dtype=vllm_dtype, kv_cache_gib=cfg.vllm_kv_cache_gib,
                                   max_num_seqs=cfg.vllm_max_num_seqs, max_model_len=cfg.max_length,
                                   extra=["--tensor-parallel-size", str(cfg.vllm_tensor_parallel_size),
                                          "--seed", str(cfg.seed)])
            atexit.register(server.stop)
        box = [server.url if server else None]
        if world > 1:
            torch.distributed.broadcast_object_list(box, src=0)
        url = box[0]
    client = VLLMServer(url, tokenizer, pushes=rank == 0, dtype=vllm_dtype, **common)
    client.server = server
    return client
