"""Accelerator setup and the few collectives the recipes need. The same accelerate config file runs on CPU and GPU:
the process group uses gloo when there is no CUDA (accelerate and DeepSpeed otherwise disagree on the world size),
and every collective carries a timeout so a lost peer fails the run instead of hanging it."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from verl_kit.config import TrainConfig
from verl_kit.data.packing import split_by_tokens
from verl_kit.errors import UserError
from verl_kit.metrics import check_writable, setup_logging
from verl_kit.models import fsdp2
from verl_kit.train.output_dir import check_output_dir

logger = logging.getLogger(__name__)


def trackers(cfg: TrainConfig) -> list[str]:
    """--report_to checked against what is installed: a tracker named but not installed stops the run in one line
    (accelerate would drop it with a debug message), and `all` means every installed one."""
    from accelerate.tracking import get_available_trackers

    available = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    if cfg.trackers == ["all"]:
        return available
    missing = [t for t in cfg.trackers if t not in available]
    if missing:
        raise UserError(f"--report_to {cfg.report_to}: {', '.join(missing)} not installed "
                        f"(pip install {' '.join(m.replace('_', '-') for m in missing)}); installed: "
                        f"{', '.join(available) or 'none'}")
    return cfg.trackers


def make_accelerator(cfg: TrainConfig):
    """Start a run from a recipe config (TrainConfig fields): build the Accelerator, set up logging (INFO on the main
    process) and check that --output_dir is writable and not another run's (output_dir.check_output_dir). Gradient
    accumulation is done by the recipe (token-budget micro-batches vary in number), so accelerate and DeepSpeed are
    told 1 and never rescale the loss."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

    cuda = torch.cuda.is_available()
    bf16 = cuda if cfg.bf16 is None else cfg.bf16
    pg = InitProcessGroupKwargs(backend="nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    # FSDP2: accelerate sets up a plain multi-process run and the kit shards the models itself (models/fsdp2.py)
    with fsdp2.hidden_from_accelerate() if fsdp2.enabled() else contextlib.nullcontext():
        accelerator = Accelerator(
            # Without CUDA, accelerate only picks its multi-process CPU mode (gloo) when told `cpu`; otherwise a
            # MULTI_GPU config silently runs N independent single processes.
            cpu=not cuda and world > 1 and not deepspeed,
            mixed_precision="bf16" if bf16 else "no",
            gradient_accumulation_steps=1,
            kwargs_handlers=[pg] if world > 1 else [],
            log_with=trackers(cfg) or None,
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
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    check_output_dir(cfg)  # a fresh run refuses another run's checkpoints, before anything loads
    return accelerator


def zero_stage(accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else int(plugin.zero_stage)


def sharding(accelerator) -> str:
    """How the run places its models: "fsdp2", "zero<stage>" (DeepSpeed), "ddp" (several processes) or "none"."""
    if fsdp2.enabled() and accelerator.num_processes > 1:
        return "fsdp2"
    if accelerator.state.deepspeed_plugin is not None:
        return f"zero{zero_stage(accelerator)}"
    return "ddp" if accelerator.num_processes > 1 else "none"


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors, gloo CPU tensors."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(sums: dict[str, float], maxes: dict[str, float] | None = None) -> dict[str, float]:
    """Sum `sums` and take the max of `maxes` over all processes, by name: {name: value} in, {name: total} out, one
    collective each (float64, so token counts stay exact). Every process must pass the same names."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    out = {}
    for values, op in ((sums, torch.distributed.ReduceOp.SUM), (maxes or {}, torch.distributed.ReduceOp.MAX)):
        names = sorted(values)
        if not names:
            continue
        t = torch.tensor([float(values[k].sum()) if isinstance(values[k], torch.Tensor) else float(values[k])
                          for k in names], dtype=torch.float64)
        if distributed:
            t = t.to(_collective_device())
            torch.distributed.all_reduce(t, op=op)
        out.update(zip(names, t.tolist()))
    return out


class Tally:
    """Named sums accumulated over the micro-batches of a step: `tally.add(loss=..., tokens=...)` (tensors are
    summed, detached: a loss may be tallied as it is backpropagated), then `tally.reduce(**maxes)` -> {name: sum
    over micro-batches and processes, or max over processes}."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def add(self, **values) -> None:
        for k, v in values.items():
            v = float(v.detach().sum()) if isinstance(v, torch.Tensor) else float(v)
            self.sums[k] = self.sums.get(k, 0.0) + v

    def reduce(self, **maxes) -> dict[str, float]:
        return reduce_metrics(self.sums, maxes)


def all_gather(accelerator, t: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from all processes along dim 0, in rank order."""
    if accelerator.num_processes == 1:
        return t
    t = t.to(accelerator.device).contiguous()
    parts = [torch.empty_like(t) for _ in range(accelerator.num_processes)]
    torch.distributed.all_gather(parts, t)
    return torch.cat(parts)


def all_reduce_max(value: float) -> float:
    """The max of `value` over all processes, so that every process takes the same decision."""
    return reduce_metrics({}, {"v": value})["v"]


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


def derived_seed(seed: int, step: int, k: int) -> int:
    """The one formula for a seed of step `step` of a run seeded `seed`: k = the pass over a batch (minibatch order)
    or the rank (step_seed). A pure function of the step, so a resumed run derives the same seeds."""
    return seed * 1_000_003 + step * 1009 + k


def step_seed(seed: int, step: int, rank: int) -> int:
    """A sampling seed for one step's batch on one process (its sample i then uses this + i:
    SamplingParams.sample_seed)."""
    return int(torch.randint(0, 2**31 - 1, (), generator=torch.Generator().manual_seed(derived_seed(seed, step, rank))))


def steps_indices(n: int, steps: range, per_step: int, seed: int) -> list[int]:
    """Every item index that optimizer steps `steps` read on any process (see step_indices), sorted: what a run that
    stops at --max_steps actually needs (e.g. reference log-probs), not the whole split."""
    return sorted({i for step in steps for i in step_indices(n, step, per_step, seed, 0, 1)})


def destroy(stop: int = 0) -> None:
    """A run's last call: tear the process group down (gloo otherwise warns or hangs on interpreter shutdown), all
    ranks together, and in a run of several processes end this process right there, its atexit handlers run (the
    trackers', a run-started vLLM server's stop) but not the interpreter's finalization. `stop`: the signal that
    stopped the run (checkpoint.save_if_due's return), whose number the process then exits with, 128 + it, as a
    shell reports a signal. A rank finalizing after the
    group was gone was seen to abort ("terminate called without an active exception", SIGABRT) after the run had
    saved everything, about once in 25 ZeRO-3 launches here, failing the launch; gloo's worker threads still hold
    Python objects then (pytorch#179291 describes the same crash)."""
    exit_code = 128 + stop if stop else 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        several = torch.distributed.get_world_size() > 1
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if several:
            atexit._run_exitfuncs()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
    if exit_code:
        sys.exit(exit_code)


def size_metrics(model, world_size: int) -> dict:
    """What the offline recipes log at step 0 of a run: world_size, params/total (the whole model's parameters) and
    params/local (those this rank holds: about total / world under ZeRO-3 or FSDP2)."""
    local, total = param_counts(model)
    return {"world_size": world_size, "params/total": total, "params/local": local}


def param_counts(model) -> tuple[int, int]:
    """(parameters held by this rank, parameters of the whole model). Under ZeRO-3 a parameter's local shard is
    `ds_tensor` and its full size `ds_numel`; under FSDP2 a DTensor's local shard; otherwise every rank holds
    everything."""
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else fsdp2.local_numel(p) for p in model.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return local, total


def micro_batches(cfg: TrainConfig, items: list, costs: list[int]) -> list[list]:
    """Split this process's `items` of a step into micro-batches (lists of items, in order): by token budget when
    `cfg.max_tokens_per_microbatch` is set (`costs` = tokens per item; in as many balanced chunks as the busiest
    process needs, so every process runs the same number: ZeRO-3 runs forward passes in lockstep), else
    `cfg.per_device_train_batch_size` items at a time."""
    if cfg.max_tokens_per_microbatch:
        n = int(all_reduce_max(len(split_by_tokens(costs, cfg.max_tokens_per_microbatch))))
        return [[items[i] for i in c] for c in split_by_tokens(costs, None, n_chunks=n)]
    size = cfg.per_device_train_batch_size
    return [items[i:i + size] for i in range(0, len(items), size)]


@dataclass
class Update:
    """One optimizer step of a rollout batch's update schedule (see `updates`): pass `epoch`, the minibatch's rollout
    `rows`, their micro-batches `chunks` (micro_batches), and whether it is the step's `last` update (the LR
    schedule advances once per step)."""

    epoch: int
    rows: list[int]
    chunks: list[list[int]]
    last: bool


def updates(cfg: TrainConfig, step: int, costs: list[int], epochs: int, num_mini_batches: int) -> Iterator[Update]:
    """The online recipes' update loop over one rollout batch of len(costs) rows (`costs`: tokens of each row's
    forward pass): `epochs` passes, each over the rows in a new seeded order (derived from cfg.seed, step and the
    pass) cut into `num_mini_batches` minibatches, each split into micro-batches. Collective when micro-batches are
    cut by a token budget."""
    for epoch in range(epochs):
        mbs = minibatches(len(costs), num_mini_batches, derived_seed(cfg.seed, step, epoch))
        for j, rows in enumerate(mbs):
            yield Update(epoch, rows, micro_batches(cfg, rows, [costs[i] for i in rows]),
                         epoch == epochs - 1 and j == len(mbs) - 1)


def minibatches(n_rows: int, num_mini_batches: int, seed: int) -> list[list[int]]:
    """This process's rollout rows 0..n_rows-1 in a seeded random order, cut into `num_mini_batches` minibatches
    (one optimizer step each). `seed` should differ per step and epoch so each pass sees a new order."""
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    size = -(-n_rows // num_mini_batches)
    return [perm[i:i + size] for i in range(0, n_rows, size)]
