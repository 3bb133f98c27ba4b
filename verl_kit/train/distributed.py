"""The few collectives the recipes need (each under the process group's timeout: train/accelerator.py), the data
position as a function of the step, the split of a step into micro-batches, and the run's last call (destroy)."""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from verl_kit.config import BatchConfig, TrainConfig
from verl_kit.data.packing import split_by_tokens

logger = logging.getLogger(__name__)


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


def global_quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile(q) (linear interpolation) of the 1-D `values` of every process together (any number on each;
    NaN when there are none anywhere). Collective: every process calls it, in the same order."""
    local = values.detach().float().flatten().cpu()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    if distributed:
        device = _collective_device()
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(sizes, torch.tensor([len(local)], device=device))
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, device=device)
        padded[:len(local)] = local.to(device)
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded)
        local = torch.cat([p[:int(n)].cpu() for p, n in zip(parts, sizes)])
    return float(torch.quantile(local, q)) if len(local) else math.nan


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of `t` over all processes (collective), on the CPU; `t` itself with one process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return t
    out = t.to(_collective_device())
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
    return out.cpu()


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


def micro_batches(cfg: BatchConfig, items: list, costs: list[int]) -> list[list]:
    """Split this process's `items` of a step into micro-batches (lists of items, in order): by token budget when
    `cfg.token_budget` is set (--max_tokens_per_microbatch, or the memory plan's choice under auto; `costs` = tokens
    per item; in as many balanced chunks as the busiest process needs, so every process runs the same number: ZeRO-3
    runs forward passes in lockstep), else `cfg.per_device_train_batch_size` items at a time."""
    if cfg.token_budget:
        n = int(all_reduce_max(len(split_by_tokens(costs, cfg.token_budget))))
        return [[items[i] for i in c] for c in split_by_tokens(costs, None, n_chunks=n)]
    size = cfg.per_device_train_batch_size
    return [items[i:i + size] for i in range(0, len(items), size)]


@dataclass
class Update:
    """One optimizer step of a rollout batch's update schedule (see `updates`): pass `epoch`, the minibatch's rollout
    `rows`, their micro-batches `chunks`, and whether it is the step's `last` update (the LR schedule advances once per
    step). A context manager: an out-of-memory error inside is taken by its `attempt` (train/out_of_memory.py), and
    `updates` yields the same rows again at half the tokens."""

    epoch: int
    rows: list[int]
    chunks: list[list[int]]
    last: bool
    attempt: object = None

    def __enter__(self) -> Update:
        self.attempt.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        return self.attempt.__exit__(*exc)


def updates(cfg: TrainConfig, step: int, costs: list[int], epochs: int, num_mini_batches: int, models: tuple = (),
            tally: Tally | None = None) -> Iterator[Update]:
    """The online recipes' update loop over one rollout batch of len(costs) rows (`costs`: tokens of each row's
    forward pass): `epochs` passes, each over the rows in a new seeded order (derived from cfg.seed, step and the
    pass) cut into `num_mini_batches` minibatches, each split into micro-batches: one optimizer step of the
    Trainables `models`, yielded again at half the tokens when the `with update:` block ran out of memory (`tally`
    put back; train/out_of_memory.py). Collective when micro-batches are cut by a token budget."""
    from verl_kit.train.out_of_memory import attempts

    for epoch in range(epochs):
        mbs = minibatches(len(costs), num_mini_batches, derived_seed(cfg.seed, step, epoch))
        for j, rows in enumerate(mbs):
            for attempt in attempts(models, cfg, step, rows, [costs[i] for i in rows], tally):
                yield Update(epoch, rows, attempt.chunks, epoch == epochs - 1 and j == len(mbs) - 1, attempt)


def minibatches(n_rows: int, num_mini_batches: int, seed: int) -> list[list[int]]:
    """This process's rollout rows 0..n_rows-1 in a seeded random order, cut into `num_mini_batches` minibatches
    (one optimizer step each). `seed` should differ per step and epoch so each pass sees a new order."""
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    size = -(-n_rows // num_mini_batches)
    return [perm[i:i + size] for i in range(0, n_rows, size)]
