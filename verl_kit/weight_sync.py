"""Weight sync: the trainer's policy (ZeRO-3 shards) -> a vLLM engine, after every update; then a logprob probe.

Every process gathers the parameters in buckets of at most `bucket_mb` MiB (`deepspeed.zero.GatheredParameters` per
bucket, never the whole model at once), the pushing process serialises each bucket with safetensors and hands it to
the engine's workers through vLLM's public RPC surface (`LLM.collective_rpc` in process, `POST /collective_rpc` of a
server started with VLLM_SERVER_DEV_MODE=1), into the `WorkerExtension` below (`--worker-extension-cls
verl_kit.weight_sync.WorkerExtension`). The extension stages the buckets and commits them with the worker's
`reload_weights`, which runs the model's own `load_weights` (HF checkpoint names, q/k/v and gate/up fusion) and then
the platform's post-load processing, layer by layer. That last step is why this route works on CPU, where vLLM
repacks linear weights at load time (a oneDNN-packed copy that the matmul reads instead of `weight`) and a plain
in-place `load_weights` has no weight loader to call. The prefix cache is reset after each commit (cached KV of the
old policy must not be reused).

Tied parameters (`tie_word_embeddings`: the output layer is the input embedding). vLLM ties the two modules to one
tensor, and on CPU the output layer `lm_head` computes the logits from its own packed copy of it, made when it is
post-processed. The layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py) post-processes a module
only when its own weights arrive; HF's `named_parameters()` names a tied tensor once (`model.embed_tokens.weight`),
so `lm_head` used to get no weight, no processing ("ParallelLMHead: Failed to load weights" in the engine log), and
kept logits from the first load's weights: the new embeddings with the old output layer, a probe diff that grows
with every update. Two things make a tied engine exact:
- the trainer sends each tensor once but with every name it has in the module tree (`named_tensors`; the other
  names travel as aliases in the bucket's safetensors header), and the extension feeds the model's `load_weights`
  every name, so `lm_head` is reloaded and post-processed like an untied one;
- after the reload the extension re-runs vLLM's post-load step on every module that shares a parameter with
  another (`_verl_kit_reprocess_shared`), as vLLM's first load does, so a tied module is right even where a model's
  loader drops the alias name.
Untied models are unchanged (no aliases, no shared modules).

A GPU fast path (NCCL / CUDA IPC through vLLM's weight-transfer API, no serialisation) can come back with a GPU test.

The check after each sync lives with the backends (verl_kit.vllm_rollout.Probe): engine and trainer score a few fixed
sequences (prompt log-probs), with `trainer_logprobs` and `max_abs_diff` below, logged as
`rollout/logprob_max_abs_diff`. An fp32 engine matches an fp32 trainer to ~1e-6 (tiny model, tied or not, on CPU);
a stale tied output layer was 0.4 to 2 nats off after one large update.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterator

import torch

from verl_kit import lora
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


def named_tensors(model) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Each parameter of the policy once, with every name it has in the module tree: a tied output layer is the input
    embedding under a second name (`lm_head.weight` = `model.embed_tokens.weight`), which `named_parameters()` leaves
    out. Of a LoRA policy, the base weights under their plain names; the adapter is merged in by `gathered_buckets`."""
    by_id: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not lora.is_adapter_param(name):
            by_id.setdefault(id(p), ([], p))[0].append(lora.base_name(name))
    return list(by_id.values())


def buckets(model, bucket_bytes: int) -> list[list[tuple[list[str], torch.nn.Parameter]]]:
    """Parameters (with all their names) in order, grouped so a bucket's full (gathered) size stays under
    bucket_bytes; a parameter larger than the budget is a bucket of its own."""
    out, cur, size = [], [], 0
    for names, p in named_tensors(model):
        n = _nbytes(p)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((names, p))
        size += n
    return out + [cur] if cur else out


def gathered_buckets(model, bucket_bytes: int) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Yield each bucket as ({engine name: full CPU tensor}, {alias: engine name}); a tied tensor is sent once, its
    other names ride along as aliases; a LoRA layer's weight is sent merged (W + scale * B @ A, gathered with its A
    and B). Collective under ZeRO-3: every process iterates it to the end, in order."""
    adapted = lora.lora_layers(model)
    for bucket in buckets(model, bucket_bytes):
        extra = [q for _, p in bucket if id(p) in adapted for q in lora.adapter_params(adapted[id(p)])]
        with gathered_params(model, [p for _, p in bucket] + extra):
            tensors = {engine_name(names[0]): (lora.merged_weight(adapted[id(p)], p.data) if id(p) in adapted
                                               else p.data).detach().to("cpu", copy=True).contiguous()
                       for names, p in bucket}
        aliases = {engine_name(a): engine_name(names[0]) for names, _ in bucket for a in names[1:]}
        yield tensors, aliases


_ALIASES = "verl_kit.aliases"  # safetensors header metadata: {alias: name of the tensor sent}


def encode(tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str:
    """A bucket as base64 safetensors (aliases in its header): a string, so it crosses both collective_rpc and the
    server's JSON endpoint."""
    from safetensors.torch import save

    metadata = {_ALIASES: json.dumps(aliases)} if aliases else None
    return base64.b64encode(save(tensors, metadata=metadata)).decode("ascii")


def decode(blob: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    raw = base64.b64decode(blob)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return load(raw), json.loads(header.get("__metadata__", {}).get(_ALIASES, "{}"))


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods are called by name through collective_rpc.
    Buckets are staged on the worker and committed at once: vLLM's layerwise reload processes a layer when all its
    weights have arrived, and a fused qkv layer may straddle two buckets."""

    def verl_kit_stage(self, blob: str) -> int:
        tensors, aliases = decode(blob)
        staged = self.__dict__.setdefault("_verl_kit_staged", {})
        staged.update(tensors)
        self.__dict__.setdefault("_verl_kit_aliases", {}).update(aliases)
        return len(staged)

    def verl_kit_commit(self) -> int:
        staged = self.__dict__.pop("_verl_kit_staged", {})
        aliases = self.__dict__.pop("_verl_kit_aliases", {})
        # Every name of a tied tensor, the aliases last (as in a checkpoint that stores lm_head separately): the
        # model's load_weights then loads the tied output layer like any other layer, see the module docstring.
        weights = list(staged.items()) + [(a, staged[name]) for a, name in aliases.items()]
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._verl_kit_reprocess_shared()
        return len(weights)

    def _verl_kit_reprocess_shared(self) -> None:
        """Re-run vLLM's post-load step (`quant_method.process_weights_after_loading`, what the first load runs on
        every module once all weights are in) on each module that shares a parameter with another module. The
        layerwise reload only post-processes a module whose own weights arrive through the model's `load_weights`;
        a module whose weight is written through its partner (a tied lm_head, when a model's loader drops the
        `lm_head.weight` alias) would keep state derived from the old weight, e.g. the oneDNN-packed copy vLLM on
        CPU computes the logits with. The same inputs as at first load (the shared, already processed tensor),
        so the same result; for unquantized embeddings it rebuilds that packed copy on CPU and is a no-op on GPU.
        Uses the worker's public `get_model()` and `vllm_config` (the context `Worker.reload_weights` sets too):
        vLLM has no call that re-processes a module without reloading it."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        modules = list(self.get_model().modules())
        holders: dict[int, int] = {}
        for m in modules:
            for p in m.parameters(recurse=False):
                holders[id(p)] = holders.get(id(p), 0) + 1
        shared = [m for m in modules if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
                  and any(holders[id(p)] > 1 for p in m.parameters(recurse=False))]
        with set_current_vllm_config(self.vllm_config):
            for m in shared:
                m.quant_method.process_weights_after_loading(m)


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

    for tensors, aliases in gathered_buckets(model, int(bucket_mb * 2**20)):
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if push is not None:
            push(encode(tensors, aliases), left(f"bucket {n_buckets} not sent"))
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
