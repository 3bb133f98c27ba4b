"""Accelerator setup and the few collectives the recipes need. The same accelerate config file runs on CPU and GPU:
the process group uses gloo when there is no CUDA (accelerate and DeepSpeed otherwise disagree on the world size),
and every collective carries a timeout so a lost peer fails the run instead of hanging it."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os

import torch

from verl_kit.packing import split_by_tokens

logger = logging.getLogger(__name__)


def make_accelerator(cfg, project_name: str = "verl-kit"):
    """Build the Accelerator for a recipe config (TrainConfig fields). Gradient accumulation is done by the recipe
    (token-budget micro-batches vary in number), so accelerate and DeepSpeed are told 1 and never rescale the loss."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

    cuda = torch.cuda.is_available()
    bf16 = cuda if cfg.bf16 is None else cfg.bf16
    pg = InitProcessGroupKwargs(backend="nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(
        # Without CUDA, accelerate only picks its multi-process CPU mode (gloo DDP) when told `cpu`; otherwise a
        # MULTI_GPU config silently runs N independent single processes.
        cpu=not cuda and world > 1 and not deepspeed,
        mixed_precision="bf16" if bf16 else "no",
        gradient_accumulation_steps=1,
        kwargs_handlers=[pg] if world > 1 else [],
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
    )
    if world > 1 and accelerator.num_processes == 1 or world > 1 and accelerator.distributed_type.value == "NO":
        raise RuntimeError(f"launched with WORLD_SIZE={world} but accelerate set up no distributed backend "
                           f"({accelerator.distributed_type}); check the accelerate config")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # fill the "auto" fields that accelerate would take from a dataloader
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.per_device_train_batch_size
        ds["gradient_accumulation_steps"] = 1
        ds["train_batch_size"] = cfg.per_device_train_batch_size * accelerator.num_processes
        ds["gradient_clipping"] = cfg.max_grad_norm
    set_seed(cfg.seed)
    return accelerator


def zero_stage(accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else int(plugin.zero_stage)


@contextlib.contextmanager
def micro_step(accelerator, model, last: bool):
    """One micro-batch of a step. Gradients are reduced (and DeepSpeed steps its engine) only on the last one."""
    accelerator.sync_gradients = last
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield


def clip_grad_norm(accelerator, model, max_norm: float) -> float:
    """Clip and return the global gradient norm. DeepSpeed clips inside its engine step (gradient_clipping)."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        norm = model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")
    return float(accelerator.clip_grad_norm_(model.parameters(), max_norm))


def all_reduce_sum(accelerator, values: list[float]) -> list[float]:
    """Sum a few floats over all processes (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def all_gather(accelerator, t: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from all processes along dim 0, in rank order."""
    if accelerator.num_processes == 1:
        return t
    t = t.to(accelerator.device).contiguous()
    parts = [torch.empty_like(t) for _ in range(accelerator.num_processes)]
    torch.distributed.all_gather(parts, t)
    return torch.cat(parts)


def all_reduce_max(accelerator, value: int) -> int:
    t = torch.tensor([value], dtype=torch.long, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def shard(n: int, rank: int, world: int) -> list[int]:
    """Indices of `n` items for `rank`, padded by wrapping so every rank gets ceil(n/world) of them: under ZeRO-3
    every rank must run the same number of forward passes."""
    per_rank = -(-n // world)
    return [(rank + world * k) % n for k in range(per_rank)]


def unshard(gathered: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """Inverse of shard(): (world * per_rank, ...) gathered in rank order -> (n, ...) in item order."""
    per_rank = gathered.shape[0] // world
    order = gathered.view(world, per_rank, *gathered.shape[1:]).transpose(0, 1).reshape(-1, *gathered.shape[1:])
    return order[:n]


def step_indices(n: int, step: int, per_step: int, seed: int, rank: int, world: int) -> list[int]:
    """Data position as a pure function of the step: the stream is one seeded permutation of range(n) per epoch,
    optimizer step `step` takes items [step*per_step, (step+1)*per_step) of it, split contiguously across ranks.
    Resuming at step k therefore reads exactly what the uninterrupted run read."""
    start = step * per_step
    out = []
    perms: dict[int, list[int]] = {}
    for pos in range(start, start + per_step):
        epoch, i = divmod(pos, n)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 100003 + epoch)
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        out.append(perms[epoch][i])
    k = per_step // world
    return out[rank * k:(rank + 1) * k]


def destroy() -> None:
    """Tear the process group down at exit (gloo otherwise warns or hangs on interpreter shutdown)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def param_counts(model) -> tuple[int, int]:
    """(parameters held by this rank, parameters of the whole model). Under ZeRO-3 a parameter's local shard is
    `ds_tensor` and its full size `ds_numel`; otherwise every rank holds everything."""
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return local, total


def lockstep_micro_batches(accelerator, items: list, costs: list[int], max_tokens: int | None,
                           batch_size: int) -> list[list]:
    """Split `items` into micro-batches: by token budget (`costs` per item, at most `max_tokens` summed, in as many
    balanced chunks as the busiest process needs, so every process runs the same number: ZeRO-3 runs forward
    passes in lockstep), or `batch_size` items at a time when max_tokens is None."""
    if max_tokens:
        n = all_reduce_max(accelerator, len(split_by_tokens(costs, max_tokens)))
        return [[items[i] for i in c] for c in split_by_tokens(costs, None, n_chunks=n)]
    return [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
