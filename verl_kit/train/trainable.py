"""Models placed for training or inference on any backend (one process, DDP, DeepSpeed ZeRO-2/3, FSDP2): the one place
where an optimizer step happens.

Trainable  a model with its own AdamW, LR schedule and (under DeepSpeed) its own engine. Every recipe drives every
           trained model the same way:
               for chunk in model.accumulate(chunks):   # micro-batches of one optimizer step
                   model.backward(loss_of(chunk))        # accumulates, never steps
               grad_norm = model.step()                  # clip, update, zero, advance the schedule
           A step whose loss or gradient norm is not finite is skipped on every process (nothing reaches the
           weights or the optimizer state), counted in `nonfinite_skips`; MAX_NONFINITE_SKIPS in a row stop the run.
frozen()   a model that is only run forward (reference, reward model): a ZeRO-3 inference engine over its shards,
           fully_shard-ed under FSDP2, or a plain module on the device.

Under FSDP2 (models/fsdp2.py) a Trainable is sharded by the kit, not prepared by accelerate (which would wrap it in
DDP): its model and optimizer are checkpointed by train/checkpoint.py with torch distributed checkpointing.

Several Trainables can live in one run (PPO's actor and critic): each is made by its own `accelerator.prepare(model,
optimizer)` with the same DeepSpeed plugin, so each has its own optimizer, clipping norm and grad norm, and
accelerate's save_state/load_state checkpoints every engine with its optimizer. One catch (accelerate 1.15,
Accelerator.backward): every loss would go to the engine prepared first, so Trainable drives each DeepSpeed engine
through DeepSpeed's public backward/step instead of accelerator.backward.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.models import fsdp2
from verl_kit.models.loading import (
    chat_template_kwargs,
    check_shared_tokenizer,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from verl_kit.train.distributed import all_reduce_max, sharding, zero_stage

logger = logging.getLogger(__name__)

# A skipped step changes nothing, so when the cause is the model or the optimizer state (a learning rate that
# overflows, a loss that is NaN by construction) every later step fails the same way and the run should stop; a bad
# batch is transient, and ten in a row is far past chance. GRPO/PPO take num_iterations x num_mini_batches steps from
# one rollout (1 by default, 8 at 2 x 4): one bad rollout stays under the bound. Megatron stops at the first NaN
# (--check-for-nan-in-loss-and-grad); PyTorch's GradScaler never stops (fp16 overflow is routine there, not here).
MAX_NONFINITE_SKIPS = 10
# The run's Trainables sharded with FSDP2, in the order they were built: accelerate does not hold them (they are not
# prepared), so checkpoint.py saves and loads their model and optimizer state itself.
FSDP2_TRAINABLES: list[Trainable] = []


class Trainable:
    """A trained model, its optimizer and LR schedule (see the module docstring for the loop). Reads the optimizer
    flags of a TrainConfig (`weight_decay`, `lr_scheduler_type`, `warmup_ratio`, `max_grad_norm`); `learning_rate`
    is passed so that two models of one run (actor, critic) can differ."""

    def __init__(self, accelerator, model: nn.Module, cfg: TrainConfig, learning_rate: float, total_steps: int):
        from transformers import get_scheduler

        self.accelerator, self.max_grad_norm = accelerator, cfg.max_grad_norm
        self.fsdp2 = sharding(accelerator) == "fsdp2"
        if self.fsdp2:  # sharded before the optimizer is built: it holds the DTensor shards
            model = fsdp2.shard(model, accelerator.device, accelerator.mixed_precision == "bf16")
        trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA model: the adapter (and any head)
        optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=cfg.weight_decay)
        self.scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, int(cfg.warmup_ratio * total_steps),
                                       total_steps)
        if self.fsdp2:  # not prepared: accelerate would wrap it in DDP; checkpointed by checkpoint.py itself
            self.model, self.optimizer = model, optimizer
            FSDP2_TRAINABLES.append(self)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)  # stepped here: accelerate would step it per process
        self.deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
        self.nonfinite_skips = 0  # optimizer steps skipped for a non-finite loss or gradient norm, since the start
        self.consecutive_skips = 0

    def accumulate(self, chunks: list) -> Iterator:
        """Yield the micro-batches of one optimizer step. Gradients of each `backward` inside accumulate locally and
        are reduced over processes on the last micro-batch only (DDP's no_sync around its forward and backward,
        DeepSpeed's gradient-accumulation boundary). Nothing is updated until `step()`."""
        for j, chunk in enumerate(chunks):
            last = j == len(chunks) - 1
            if self.deepspeed:
                self.model.set_gradient_accumulation_boundary(last)
                yield chunk
                continue
            self.accelerator.sync_gradients = last
            if self.fsdp2:  # gradients reduce-scattered on the last micro-batch only
                self.model.set_requires_gradient_sync(last)
                yield chunk
                continue
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                yield chunk

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (a micro-batch of `accumulate`). Never updates the model. A non-finite
        loss is multiplied by NaN (a finite one by exactly 1, without a device sync), so that its gradients are NaN
        even where the loss's non-finite part had none: step() then has one gate, the global gradient norm, which
        every backend reduces over the processes."""
        loss = loss * torch.ones_like(loss).masked_fill(~torch.isfinite(loss.detach()), math.nan)
        if self.deepspeed:
            self.model.backward(loss)
        else:
            self.accelerator.backward(loss)

    def step(self, schedule: bool = True) -> float:
        """Apply the accumulated update, clipped to max_grad_norm, zero the gradients and, if `schedule`, advance the
        LR schedule by one. Returns the global gradient norm before clipping.

        When the norm is not finite (a NaN or inf gradient, or a non-finite loss: see backward) every process skips
        the update: the gradients are zeroed, the optimizer is not stepped (its moments and step count stay as they
        were), the LR schedule still advances (a skipped step is lost, not postponed: the schedule stays a function
        of the step number, as resume expects). Under DeepSpeed the engine takes that decision on the global norm it
        reduces (DeepSpeed 0.19 skips such a step under ZeRO-3, and under ZeRO-1/2 in fp32 or with bf16's
        check_grad_overflow, its default); elsewhere the flag is reduced over the processes. Each skip is counted
        in `nonfinite_skips` and warned; MAX_NONFINITE_SKIPS in a row stop the run with one line."""
        if self.deepspeed:  # the engine clips (gradient_clipping = max_grad_norm), steps and zeroes
            self.model.step()
            measured = self.model.get_global_grad_norm()  # None: ZeRO-1/2 with compute_grad_norm false
            norm = float(measured) if measured is not None else float("nan")
            skipped = not self.model.was_step_applied()
            if not skipped and measured is not None and not math.isfinite(norm):
                raise UserError(f"DeepSpeed applied an update whose gradient norm is {norm}: the weights are no "
                                "longer finite. Enable its check (bf16.check_grad_overflow true in the DeepSpeed "
                                "config) so that such a step is skipped")
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if self.fsdp2:  # the norm of DTensor gradients is a DTensor, reduced over the shards
                norm = float(fsdp2.full_tensor(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)))
            else:
                norm = float(self.accelerator.clip_grad_norm_(params, self.max_grad_norm))
            skipped = bool(all_reduce_max(float(not math.isfinite(norm))))
            if not skipped:
                self.optimizer.step()
            self.optimizer.zero_grad()
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

    def unwrapped(self) -> nn.Module:
        """The HF model inside the DDP/DeepSpeed wrapper (its parameters are still ZeRO-3 shards)."""
        return self.accelerator.unwrap_model(self.model)


def frozen(accelerator, loader):
    """Build a frozen model with `loader()` and place it: under ZeRO-3 a DeepSpeed inference engine over its shards
    (every process must then run the same number of forward passes; 1/world of its size per process, as TRL's
    prepare_deepspeed does), under FSDP2 fully_shard-ed the same way as a trained model (the same lockstep),
    otherwise a plain module on the device."""
    if sharding(accelerator) == "fsdp2":
        model = loader().requires_grad_(False)
        return fsdp2.shard(model, accelerator.device, accelerator.mixed_precision == "bf16").eval()
    if zero_stage(accelerator) == 3:
        import deepspeed

        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": 1, "bf16": copy.deepcopy(ds.get("bf16", {"enabled": False}))}
        model = loader()
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval() returns None
        return engine
    return loader().to(accelerator.device).requires_grad_(False).eval()


def load_teacher(accelerator, spec: str, tokenizer, attn_implementation: str | None = None):
    """The frozen teacher named by `--teacher_model_name_or_path spec`, placed as `frozen` places it, once its
    tokenizer is checked to be the student's `tokenizer` (the teacher scores the student's token ids: one vocabulary,
    one chat template; models.check_shared_tokenizer's one-line UserError otherwise)."""
    path = resolve_model_path(spec)
    teacher_tokenizer = load_tokenizer(path, chat_template_kwargs(tokenizer))  # rendered with the same kwargs
    check_shared_tokenizer(tokenizer, teacher_tokenizer, f"--teacher_model_name_or_path {spec}")
    return frozen(accelerator, lambda: load_causal_lm(path, attn_implementation))
