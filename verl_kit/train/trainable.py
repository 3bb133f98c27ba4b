"""Models placed for training or inference on any backend (one process, DDP, DeepSpeed ZeRO-2/3, FSDP2): the one place
where an optimizer step happens.

Trainable  a model with its own AdamW, LR schedule and (under DeepSpeed) its own engine. Every recipe drives every
           trained model the same way:
               for chunk in model.accumulate(chunks):   # micro-batches of one optimizer step
                   model.backward(loss_of(chunk))        # accumulates, never steps
               grad_norm = model.step()                  # clip, update, zero, advance the schedule
           A step whose loss or gradient norm is not finite is skipped on every process (nothing reaches the
           weights or the optimizer state), counted in `nonfinite_skips`; MAX_NONFINITE_SKIPS in a row stop the run.
           A step that runs out of memory is redone at half the tokens per micro-batch (`attempts`,
           train/out_of_memory.py).
frozen()   a model that is only run forward (reference, reward model): a ZeRO-3 inference engine over its shards,
           fully_shard-ed under FSDP2, or a plain module on the device.

What differs between backends (sharding the model, gradient sync, backward and step, checkpoint files) is asked of
the run's Sharding (train/sharding.py); nothing here tests which backend runs. Several Trainables can live in one run
(PPO's actor and critic): each is prepared on its own, so each has its own optimizer, clipping norm and grad norm,
and the sharding checkpoints every one with its optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from verl_kit.config import OptimConfig
from verl_kit.errors import UserError
from verl_kit.models.loading import (
    chat_template_kwargs,
    check_shared_tokenizer,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)

logger = logging.getLogger(__name__)

# A skipped step changes nothing, so when the cause is the model or the optimizer state (a learning rate that
# overflows, a loss that is NaN by construction) every later step fails the same way and the run should stop; a bad
# batch is transient, and ten in a row is far past chance. GRPO/PPO take num_iterations x num_mini_batches steps from
# one rollout (1 by default, 8 at 2 x 4): one bad rollout stays under the bound. Megatron stops at the first NaN
# (--check-for-nan-in-loss-and-grad); PyTorch's GradScaler never stops (fp16 overflow is routine there, not here).
MAX_NONFINITE_SKIPS = 10


class Trainable:
    """A trained model, its optimizer and LR schedule (see the module docstring for the loop), placed by the run's
    sharding (`accelerator.sharding`, train/sharding.py). Reads the optimizer flags of an OptimConfig
    (`weight_decay`, `lr_scheduler_type`, `warmup_ratio`, `max_grad_norm`); `learning_rate` is passed so that two
    models of one run (actor, critic) can differ."""

    def __init__(self, accelerator, model: nn.Module, cfg: OptimConfig, learning_rate: float, total_steps: int):
        from transformers import get_scheduler

        self.accelerator, self.sharding, self.max_grad_norm = accelerator, accelerator.sharding, cfg.max_grad_norm
        model = self.sharding.shard(model)  # before the optimizer is built: under FSDP2 it holds the DTensor shards
        trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA model: the adapter (and any head)
        optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=cfg.weight_decay)
        self.scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, int(cfg.warmup_ratio * total_steps),
                                       total_steps)
        self.model, self.optimizer = self.sharding.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)  # stepped here: accelerate would step it per process
        self.steps_taken = 0  # calls of step() since the start of this process
        self.nonfinite_skips = 0  # optimizer steps skipped for a non-finite loss or gradient norm, since the start
        self.consecutive_skips = 0

    def attempts(self, cfg, step: int, items: list, costs: list[int], tally=None) -> Iterator:
        """The tries at optimizer step `step` over this process's `items` (`costs` tokens each), each a context
        manager with the step's micro-batches (`.chunks`, split by `cfg`'s token budget); one more after a try that ran
        out of memory, at half the budget (train/out_of_memory.py: what is put back, where the run stops instead)."""
        from verl_kit.train.out_of_memory import attempts

        return attempts((self,), cfg, step, items, costs, tally)

    def discard(self) -> None:
        """Drop the gradients accumulated in a step that will not be applied."""
        self.sharding.discard(self.model, self.optimizer)

    def accumulate(self, chunks: list) -> Iterator:
        """Yield the micro-batches of one optimizer step. Gradients of each `backward` inside accumulate locally and
        are reduced over processes on the last micro-batch only (DDP's no_sync around its forward and backward,
        DeepSpeed's gradient-accumulation boundary, FSDP2's requires_gradient_sync). Nothing is updated until
        `step()`."""
        for j, chunk in enumerate(chunks):
            with self.sharding.accumulating(self.model, j == len(chunks) - 1):
                yield chunk

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (a micro-batch of `accumulate`). Never updates the model. A non-finite
        loss is multiplied by NaN (a finite one by exactly 1, without a device sync), so that its gradients are NaN
        even where the loss's non-finite part had none: step() then has one gate, the global gradient norm, which
        every backend reduces over the processes."""
        loss = loss * torch.ones_like(loss).masked_fill(~torch.isfinite(loss.detach()), math.nan)
        self.sharding.backward(self.model, loss)

    def step(self, schedule: bool = True) -> float:
        """Apply the accumulated update, clipped to max_grad_norm, zero the gradients and, if `schedule`, advance the
        LR schedule by one. Returns the global gradient norm before clipping.

        When the norm is not finite (a NaN or inf gradient, or a non-finite loss: see backward) every process skips
        the update: the gradients are zeroed, the optimizer is not stepped (its moments and step count stay as they
        were), the LR schedule still advances (a skipped step is lost, not postponed: the schedule stays a function
        of the step number, as resume expects). The sharding takes that decision (Sharding.step: DeepSpeed's engine
        on the global norm it reduces, elsewhere a flag reduced over the processes). Each skip is counted in
        `nonfinite_skips` and warned; MAX_NONFINITE_SKIPS in a row stop the run with one line."""
        try:
            norm, skipped = self.sharding.step(self.model, self.optimizer, self.max_grad_norm)
        except (RuntimeError, MemoryError, OSError) as e:  # not redone: smaller micro-batches do not shrink an update
            from verl_kit.train.out_of_memory import is_out_of_memory, reason

            if not is_out_of_memory(e):
                raise
            raise UserError(f"the optimizer step ran out of memory ({reason(e)}): its state (AdamW's moments arrive "
                            "at the first step) does not fit; the run stops, the last checkpoint is intact; "
                            "--use_peft, ZeRO-3 / FSDP2 over more processes, or a smaller model "
                            "(docs/memory.md)") from e
        self.steps_taken += 1
        if schedule:
            self.scheduler.step()
        if skipped:
            self._skipped(norm)
        else:
            self.consecutive_skips = 0
        return norm

    def _skipped(self, norm: float) -> None:
        self.nonfinite_skips += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= MAX_NONFINITE_SKIPS:
            raise UserError(f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient "
                            f"norm (the last: {norm}) and were skipped: the run stops rather than go on without "
                            "learning. Look for what turns NaN (the rewards, the loss's inputs, the learning rate, "
                            "bf16 overflow); the last checkpoint holds the last finite weights")
        if self.accelerator.is_main_process:
            logger.warning("optimizer step skipped: the loss or the gradient norm (%s) is not finite; nothing was "
                           "applied (%d in a row; the run stops at %d)", norm, self.consecutive_skips,
                           MAX_NONFINITE_SKIPS)

    @property
    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def metrics(self, grad_norms: list[float]) -> dict:
        """What every recipe logs of its trained model after a step: grad_norm (the mean over the step's optimizer
        steps, `grad_norms`), nonfinite_skips (since the start) and learning_rate."""
        return {"grad_norm": sum(grad_norms) / len(grad_norms), "nonfinite_skips": self.nonfinite_skips,
                "learning_rate": self.learning_rate}

    def size_metrics(self) -> dict:
        """What a recipe logs of its model at step 0: world_size, params/total, params/local (Sharding.size_metrics)."""
        return self.sharding.size_metrics(self.model)

    def unwrapped(self) -> nn.Module:
        """The HF model inside the DDP/DeepSpeed wrapper (its parameters are still ZeRO-3 shards)."""
        return self.accelerator.unwrap_model(self.model)


def frozen(accelerator, loader):
    """Build a frozen model with `loader()` and place it as the run's sharding places a model that is only run
    forward (Sharding.frozen): under ZeRO-3 a DeepSpeed inference engine over its shards, under FSDP2 fully_shard-ed
    (both then need every process to run the same forward passes), otherwise a plain module on the device."""
    return accelerator.sharding.frozen(loader)


def load_teacher(accelerator, spec: str, tokenizer, attn_implementation: str | None = None):
    """The frozen teacher named by `--teacher_model_name_or_path spec`, placed as `frozen` places it, once its
    tokenizer is checked to be the student's `tokenizer` (the teacher scores the student's token ids: one vocabulary,
    one chat template; models.check_shared_tokenizer's one-line UserError otherwise)."""
    path = resolve_model_path(spec)
    teacher_tokenizer = load_tokenizer(path, chat_template_kwargs(tokenizer))  # rendered with the same kwargs
    check_shared_tokenizer(tokenizer, teacher_tokenizer, f"--teacher_model_name_or_path {spec}")
    return frozen(accelerator, lambda: load_causal_lm(path, attn_implementation))


class EmaTeacher:
    """`--teacher_model_kind ema` (TRL's SDFT): a frozen copy of the student, placed as `frozen` places any model,
    moved toward the student after every `sync_steps`-th optimizer step, teacher <- (1 - rate) teacher + rate student
    (TRL's SyncRefModelCallback maths). Shard by shard: the two models are sharded alike, so each process averages
    what it holds (Sharding.local), no gather. What it holds and its step count are per-process state (a checkpoint's
    rank-<i>.pt, through checkpoint.PerRank)."""

    def __init__(self, accelerator, student: Trainable, loader, rate: float, sync_steps: int):
        self.model = frozen(accelerator, loader)
        self.student, self.local = student, accelerator.sharding.local
        self.rate, self.sync_steps, self.steps = rate, sync_steps, 0
        mine, theirs = self._params()
        if mine.keys() != theirs.keys():
            odd = sorted(mine.keys() ^ theirs.keys())[:3]
            raise ValueError(f"the EMA teacher's parameters are not the student's: {odd}")

    def _params(self) -> tuple[dict, dict]:
        from accelerate.utils import extract_model_from_parallel

        return (dict(extract_model_from_parallel(self.model).named_parameters()),
                dict(self.student.unwrapped().named_parameters()))

    @torch.no_grad()
    def after_step(self) -> None:
        """Call after each optimizer step of the student."""
        self.steps += 1
        if self.steps % self.sync_steps == 0:
            mine, theirs = self._params()
            for name, p in mine.items():
                held = self.local(p)
                held.lerp_(self.local(theirs[name]).to(held.dtype), self.rate)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "weights": {n: self.local(p).detach().cpu().clone()
                                                 for n, p in self._params()[0].items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for name, p in self._params()[0].items():
            self.local(p).copy_(state["weights"][name])


def self_teacher(accelerator, student: Trainable, kind: str, model_path: str, attn_implementation: str | None,
                 lora: bool, rate: float, sync_steps: int) -> tuple[nn.Module, EmaTeacher | None]:
    """Self-distillation's teacher, the student itself (`--teacher_model_kind`, TRL's SDFT kinds): `live` the student
    as it is now (run without gradients), `base` its initial weights (frozen; with `lora` the student with its adapter
    disabled, no second copy), `ema` an EmaTeacher. -> (the model the teacher's forward runs, the EmaTeacher or
    None)."""
    if kind == "live":
        return student.model, None
    if kind == "base":
        from verl_kit.models.lora import reference

        return (reference(student.model) if lora
                else frozen(accelerator, lambda: load_causal_lm(model_path, attn_implementation))), None
    ema = EmaTeacher(accelerator, student, lambda: load_causal_lm(model_path, attn_implementation), rate, sync_steps)
    return ema.model, ema
