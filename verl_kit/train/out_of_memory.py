"""A step that runs out of memory anyway survives (docs/memory.md): the memory plan chooses the micro-batches before
step 1, and when a step still runs out (a CUDA OutOfMemoryError, on CPU the allocator's "can't allocate memory"
RuntimeError, Python's MemoryError) inside an optimizer step's micro-batches, that step is redone:

    for attempt in policy.attempts(tc, step, idx, costs, tally):    # Trainable.attempts
        with attempt:                                                # out of memory inside: redone, smaller
            for chunk in policy.accumulate(attempt.chunks):
                policy.backward(loss_of(chunk))
            grad_norm = policy.step()

    for update in train.updates(cfg, step, costs, epochs, mbs, (actor,), tally):   # the online recipes' updates,
        with update:                                                 # each redone the same way
            ...

An attempt that runs out leaves nothing behind: no optimizer step was taken (an out-of-memory error inside
`Trainable.step` itself is not retried: smaller micro-batches would not shrink it, and the update may be half
applied: the run stops in one line; so does one that strikes after another model of the attempt stepped, PPO's critic
after its actor), the gradients it accumulated are dropped, the tally it added to is put back;
the engine is not touched (weights are synced after the update). The token budget halves (from the largest
micro-batch of the attempt, never below its longest item), one warning line says so, and the same items are split
again: from then on the run is the run that `--max_tokens_per_microbatch <that budget>` would have been (the budget
is kept in every checkpoint, a resume keeps it). Micro-batches of one sequence each that still run out stop the run
in one line; the last checkpoint is intact (nothing is saved on the way out).

Where a step cannot be redone, the run stops in one line naming the budget that would have been tried: a fixed
`--max_tokens_per_microbatch` (a number means that number), a run of several processes (the others wait inside the
same collective: redoing it on one would desynchronise them; torchrun ends them when this one exits), and DeepSpeed
(its engine holds the step's partial gradient partitions, which its public API does not drop mid-step). The CUDA
error class is caught by the same path but no GPU here has run it (unmeasured)."""

from __future__ import annotations

import errno
import gc
import logging

import torch

from verl_kit.errors import UserError

logger = logging.getLogger(__name__)

MOVES = ("--gradient_checkpointing true, shorter --max_length, --use_peft, or ZeRO-3 / FSDP2 over more processes "
         "(docs/memory.md)")


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failed: torch's OutOfMemoryError (CUDA), Python's MemoryError, the CPU allocator's RuntimeError
    ("DefaultCPUAllocator: can't allocate memory", raised under an rlimit or a full machine), or an OSError ENOMEM (a
    mapping refused)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)) or (
        isinstance(e, OSError) and e.errno == errno.ENOMEM)


def reason(e: BaseException) -> str:
    """The allocator's words, without torch's enforce prefix, on one line."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.split("] ", 1)[-1].split(". ", 1)[-1][:160]


class Attempt:
    """One try at an optimizer step's micro-batches, `chunks` (lists of the step's items), of the Trainables `models`;
    a context manager that takes an out-of-memory error from its block (module docstring). `failed`: the error it
    took, else None."""

    def __init__(self, models: tuple, chunks: list[list], tally=None):
        self.models, self.chunks, self.tally, self.failed = models, chunks, tally, None

    def __enter__(self) -> Attempt:
        self._sums = dict(self.tally.sums) if self.tally is not None else None
        self._steps = [m.steps_taken for m in self.models]
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not is_out_of_memory(error):
            return False
        stepped = [m for m, n in zip(self.models, self._steps) if m.steps_taken != n]
        if stepped:
            raise UserError(f"out of memory ({reason(error)}) after {len(stepped)} model(s) of this optimizer step "
                            "had applied their update: it cannot be redone; the run stops, the last checkpoint is "
                            f"intact; set a smaller --max_tokens_per_microbatch, or {MOVES}") from error
        self.failed = error.with_traceback(None)  # its frames held the failed forward's tensors
        for m in self.models:
            m.discard()  # the attempt's gradients: nothing was applied
        if self.tally is not None:
            self.tally.sums = self._sums
        gc.collect()  # what the failed forward's graph still held
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True


def attempts(models: tuple, cfg, step: int, items: list, costs: list[int], tally=None):
    """Yield Attempts of the Trainables `models` at splitting `items` (one optimizer step's, `costs` tokens each) into
    micro-batches by `cfg` (a BatchConfig: its token budget, train.micro_batches), until one ends without running out
    of memory; between them the budget halves (module docstring), or the run stops in one line where it cannot.
    `tally`: a train.Tally the step adds to, put back to where it was after a failed attempt. `step`: the optimizer
    step's number (0-based; 1-based in messages)."""
    from verl_kit.train.distributed import micro_batches

    while True:
        positions = micro_batches(cfg, list(range(len(items))), costs)
        attempt = Attempt(models, [[items[i] for i in chunk] for chunk in positions], tally)
        yield attempt
        if attempt.failed is None:
            return
        largest = max(sum(costs[i] for i in chunk) for chunk in positions)
        tried = min(cfg.token_budget or largest, largest)  # halving what was tried: every attempt splits further
        smaller = max(tried // 2, max(costs))
        error = attempt.failed
        where = f"step {step + 1} ran out of memory ({reason(error)}) in micro-batches of up to {largest} tokens"
        if not models:  # nothing to put back: not redone
            raise error
        sharding = models[0].sharding
        if sharding.accelerator.num_processes > 1 or not sharding.can_discard:
            why = ("a run of several processes cannot redo a step on one of them" if sharding.accelerator.num_processes
                   > 1 else f"{sharding.name} cannot drop a step's partial gradients")
            raise UserError(f"{where}: the run stops ({why}; the last checkpoint is intact); set "
                            f"--max_tokens_per_microbatch {smaller} or less, or {MOVES}") from error
        if cfg.max_tokens_per_microbatch != "auto":
            raise UserError(f"{where} at --max_tokens_per_microbatch {cfg.max_tokens_per_microbatch}: the run stops "
                            f"(the last checkpoint is intact); set a smaller number, auto (the default: the step is "
                            f"then redone at half the tokens), or {MOVES}") from error
        if smaller >= tried:
            raise UserError(f"{where}, one sequence each: the run stops (the last checkpoint is intact); {MOVES}") \
                from error
        logger.warning("%s: nothing applied, its gradients dropped; redone at --max_tokens_per_microbatch %d "
                       "(auto halves it; the run keeps it, and so do its checkpoints)", where, smaller)
        cfg.chosen_token_budget = smaller
