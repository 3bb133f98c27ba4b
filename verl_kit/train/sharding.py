"""How a run places its models, asked once: the `Sharding` object, chosen where the accelerator is made
(`Accelerator(...).sharding`) from the accelerate config the run was launched with, and asked by everything that
depends on it (Trainable, frozen models, checkpoints, export, weight sync, size metrics). No other module tests which
backend runs.

    Replicated   one process, or DDP over several (accelerate prepares the model; every process holds all of it)
    DeepSpeed    ZeRO stage 1, 2 or 3 (accelerate prepares a DeepSpeed engine; stage 3 partitions the parameters)
    FSDP2        torch's fully_shard over DTensor parameters, applied by the kit (models/fsdp2.py says why)

What each answers:
    shard(model)                  before the optimizer is built (FSDP2: fully_shard; the others: the model as it is)
    prepare(model, optimizer)     -> (model, optimizer) as the trainer drives them; remembered for save/load
    frozen(loader)                a model that is only run forward, placed in the same lockstep
    accumulating(model, last)     the context of one micro-batch's forward and backward (gradient sync on the last)
    backward(model, loss), step(model, optimizer, max_grad_norm) -> (gradient norm, skipped)
    discard(model, optimizer)     drop a step's gradients mid-step, where `can_discard` (out-of-memory retries)
    whole                         the trained model is the plain module, whole in this process (one process, unsharded)
    full_params(model, params)    a context in which `full(t)` is the whole tensor (weight sync)
    full_numel(p)                 the whole parameter's size (weight-sync buckets)
    full_state_dict(model)        the whole state dict on the main process (export)
    local(p), param_counts(model) what this process holds
    save(path, lora), load(path, lora)   everything it prepared, with accelerate's scheduler and RNG state
    builds_empty                  whether this process builds the models it shards empty (rank 0 fills them)

A fourth backend is one subclass. Its `name` is recorded in every checkpoint; `layout` says which checkpoint files it
writes (a resume across layouts is refused: the files do not load)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Iterator

import accelerate
import torch
from torch import nn

from verl_kit.errors import UserError
from verl_kit.models import fsdp2
from verl_kit.models.zero3 import gathered_params
from verl_kit.train.distributed import all_reduce_max


class Sharding:
    """The one-process / DDP base; subclasses change what differs (see the module docstring)."""

    layout = "accelerate"  # accelerate's whole-model files: one process and DDP read each other's
    builds_empty = False
    can_discard = True  # a step's accumulated gradients can be dropped mid-step (train/out_of_memory.py)

    @property
    def whole(self) -> bool:
        """The trained model is the plain module itself, every parameter whole in this one process (no wrapper, no
        shards): what can read it directly (the HF rollout backend, rollout.hf.shares_policy)."""
        return self.accelerator.num_processes == 1

    def __init__(self, accelerator: accelerate.Accelerator):
        self.accelerator = accelerator
        self.name = "ddp" if accelerator.num_processes > 1 else "none"
        self.trained: list[nn.Module] = []  # the models prepared for training, in order

    def configure(self, per_device_train_batch_size: int, max_grad_norm: float) -> None:
        """Fill what the backend's own config takes from a trainer (nothing here)."""

    # ---- placing models -------------------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        model, optimizer = self.accelerator.prepare(model, optimizer)
        self.trained.append(model)
        return model, optimizer

    def frozen(self, loader: Callable[[], nn.Module]) -> nn.Module:
        return loader().to(self.accelerator.device).requires_grad_(False).eval()

    # ---- one optimizer step ---------------------------------------------------------------------------------------
    def accumulating(self, model: nn.Module, last: bool):
        """Gradients of a backward inside are reduced over the processes only when `last`."""
        self.accelerator.sync_gradients = last
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip(self, params: list[torch.Tensor], max_grad_norm: float) -> float:
        return float(self.accelerator.clip_grad_norm_(params, max_grad_norm))

    def step(self, model: nn.Module, optimizer, max_grad_norm: float) -> tuple[float, bool]:
        """Clip, update and zero -> (global gradient norm before clipping, whether the update was skipped: a norm
        that is not finite on any process skips it on every one)."""
        norm = self.clip([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        skipped = bool(all_reduce_max(float(not math.isfinite(norm))))
        if not skipped:
            optimizer.step()
        optimizer.zero_grad()
        return norm, skipped

    def discard(self, model: nn.Module, optimizer) -> None:
        """Drop the gradients accumulated so far in a step that will not be applied (train/out_of_memory.py)."""
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    # ---- full and local tensors -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def full_params(self, model: nn.Module, params: list[torch.Tensor]) -> Iterator[Callable]:
        """Within the block, `full(t)` is the whole tensor of `t` (one of `params` or computed from them). Collective
        where the parameters are sharded: every process enters it, in the same order."""
        yield lambda t: t

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.accelerator.get_state_dict(model)

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """What this process holds of parameter `p`."""
        return p

    def full_numel(self, p: torch.Tensor) -> int:
        """Elements of the whole parameter `p` (a DTensor's numel is already its global size)."""
        return p.numel()

    def param_counts(self, model: nn.Module) -> tuple[int, int]:
        """(elements this process holds, elements of the whole model)."""
        params = list(model.parameters())
        return sum(self.local(p).numel() for p in params), sum(self.full_numel(p) for p in params)

    def size_metrics(self, model: nn.Module) -> dict:
        """What a recipe logs at step 0 of a run: world_size, params/total (the whole model's parameters) and
        params/local (those this process holds: about total / world under ZeRO-3 or FSDP2)."""
        local, total = self.param_counts(model)
        return {"world_size": self.accelerator.num_processes, "params/total": total, "params/local": local}

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save(self, path: str, lora: bool) -> None:
        """Every model this sharding prepared, its optimizer, accelerate's registered objects (schedulers) and every
        process's RNG into the folder `path`; `lora`: the frozen base weights left out (the run loads them again)."""
        with self._frozen_left_out(lora) as kwargs:
            self.accelerator.save_state(path, **kwargs)

    def load(self, path: str, lora: bool) -> None:
        with self._frozen_left_out(lora, loading=path) as kwargs:
            self.accelerator.load_state(path, **kwargs)

    @contextlib.contextmanager
    def _frozen_left_out(self, active: bool, loading: str | None = None):
        """accelerate's save_state (or, `loading` a checkpoint, load_state) keyword arguments that leave frozen
        parameters out when `active`: a pre-hook drops them from the saved weights, and on load the saved names must
        be exactly the trainable ones before the model is loaded non-strictly."""
        from accelerate.utils import SAFE_MODEL_NAME

        if not active:
            yield {}
            return

        def drop(models, weights, _output_dir):
            for model, weight in zip(models, weights):
                for name in _frozen_names(model) & weight.keys():
                    del weight[name]

        def check(models, input_dir):
            from safetensors import safe_open

            for i, model in enumerate(models):
                file = os.path.join(input_dir, f"{SAFE_MODEL_NAME}{f'_{i}' if i else ''}.safetensors")  # as accelerate
                with safe_open(file, "pt") as f:
                    saved = set(f.keys())
                expected = set(model.state_dict()) - _frozen_names(model)
                if saved != expected:
                    raise UserError(f"--resume_from_checkpoint {loading}: {os.path.basename(file)} does not hold "
                                    f"this run's trainable weights (missing {sorted(expected - saved)[:3]}, "
                                    f"unexpected {sorted(saved - expected)[:3]})")

        handle = (self.accelerator.register_load_state_pre_hook(check) if loading
                  else self.accelerator.register_save_state_pre_hook(drop))
        try:
            yield {"strict": False} if loading else {}
        finally:
            handle.remove()


class DeepSpeed(Sharding):
    """DeepSpeed ZeRO (`stage` 1-3) through accelerate's DeepSpeed plugin. Trainable drives each engine through
    DeepSpeed's public backward/step: accelerate 1.15's Accelerator.backward sends every loss to the engine prepared
    first, which is wrong for a run of two (PPO's actor and critic)."""

    layout = "deepspeed"
    can_discard = False  # its engine holds a step's partial gradient partitions; no public call drops them mid-step
    whole = False  # an engine around partitions, whatever the process count

    def __init__(self, accelerator: accelerate.Accelerator):
        super().__init__(accelerator)
        self.stage = int(accelerator.state.deepspeed_plugin.zero_stage)
        self.name = f"zero{self.stage}"

    def configure(self, per_device_train_batch_size: int, max_grad_norm: float) -> None:
        """The "auto" fields that accelerate would take from a dataloader; gradient accumulation is the recipe's
        (token-budget micro-batches vary in number), so DeepSpeed is told 1 and never rescales the loss."""
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = per_device_train_batch_size
        ds["gradient_accumulation_steps"] = 1
        ds["train_batch_size"] = per_device_train_batch_size * self.accelerator.num_processes
        ds["gradient_clipping"] = max_grad_norm

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        if self.stage == 3 and getattr(model, "is_quantized", False):
            raise UserError("--load_in_4bit with ZeRO-3: 4-bit weights are not partitioned (transformers skips "
                            "zero.init for quantized models); use one process, DDP or ZeRO-2")
        return super().prepare(model, optimizer)

    def frozen(self, loader: Callable[[], nn.Module]) -> nn.Module:
        """Under ZeRO-3 an inference engine over its shards (1/world of its size per process, as TRL's
        prepare_deepspeed does; every process must then run the same number of forward passes)."""
        if self.stage != 3:
            return super().frozen(loader)
        import deepspeed

        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": 1, "bf16": copy.deepcopy(ds.get("bf16", {"enabled": False}))}
        model = loader()
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval() returns None
        return engine

    def accumulating(self, model: nn.Module, last: bool):
        model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        model.backward(loss)

    def step(self, model: nn.Module, optimizer, max_grad_norm: float) -> tuple[float, bool]:
        """The engine clips (gradient_clipping = max_grad_norm), steps and zeroes, and skips a step whose global norm
        is not finite (DeepSpeed 0.19: under ZeRO-3, and under ZeRO-1/2 in fp32 or with bf16's check_grad_overflow,
        its default)."""
        model.step()
        measured = model.get_global_grad_norm()  # None: ZeRO-1/2 with compute_grad_norm false
        norm = float(measured) if measured is not None else float("nan")
        skipped = not model.was_step_applied()
        if not skipped and measured is not None and not math.isfinite(norm):
            raise UserError(f"DeepSpeed applied an update whose gradient norm is {norm}: the weights are no longer "
                            "finite. Enable its check (bf16.check_grad_overflow true in the DeepSpeed config) so "
                            "that such a step is skipped")
        return norm, skipped

    @contextlib.contextmanager
    def full_params(self, model: nn.Module, params: list[torch.Tensor]) -> Iterator[Callable]:
        with gathered_params(model, params):  # ZeRO-3's partitions; a no-op at stages 1-2
            yield lambda t: t

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """ZeRO-3: this process's partition, the parameter's elements only. Partitions are of equal size, so the last
        ones run past the parameter's end: DeepSpeed allocates that tail (torch.empty) and never writes it, so it
        holds whatever bits the memory held (a NaN too: the non-finite check read it and refused a healthy run's
        export, once in a suite's run)."""
        part = getattr(p, "ds_tensor", None)
        if part is None:
            return p
        start = part.numel() * torch.distributed.get_rank(group=p.ds_process_group)
        return part.narrow(0, 0, max(0, min(part.numel(), p.ds_numel - start)))

    def full_numel(self, p: torch.Tensor) -> int:
        return getattr(p, "ds_numel", p.numel())  # ZeRO-3: p itself is an empty placeholder

    @contextlib.contextmanager
    def _frozen_left_out(self, active: bool, loading: str | None = None):
        """The engines leave frozen parameters out themselves: exclude_frozen_parameters on save; a non-strict
        module load, the trainable values coming back from the optimizer's partitions."""
        if not active:
            yield {}
        else:
            yield {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}


class FSDP2(Sharding):
    """torch's fully_shard, one unit per transformer layer and the root (models/fsdp2.py). The models are sharded by
    the kit, not prepared by accelerate (which would wrap them in DDP), so this class checkpoints them itself with
    torch distributed checkpointing: every process writes its own shards, beside accelerate's scheduler and RNG
    files."""

    layout = "fsdp2"
    whole = False  # DTensor shards, even on one process

    def __init__(self, accelerator: accelerate.Accelerator):
        super().__init__(accelerator)
        self.name = "fsdp2"
        self.optimizers: list[torch.optim.Optimizer] = []
        self.builds_empty = fsdp2.builds_empty()

    def shard(self, model: nn.Module) -> nn.Module:
        return fsdp2.shard(model, self.accelerator.device, self.accelerator.mixed_precision == "bf16")

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.trained.append(model)
        self.optimizers.append(optimizer)
        return model, optimizer

    def frozen(self, loader: Callable[[], nn.Module]) -> nn.Module:
        """fully_shard-ed as a trained model is (the same lockstep)."""
        return self.shard(loader().requires_grad_(False)).eval()

    def accumulating(self, model: nn.Module, last: bool):
        """Gradients reduce-scattered on the last micro-batch only."""
        self.accelerator.sync_gradients = last
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip(self, params: list[torch.Tensor], max_grad_norm: float) -> float:
        # the norm of DTensor gradients is a DTensor, reduced over the shards
        return float(fsdp2.full_tensor(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))

    @contextlib.contextmanager
    def full_params(self, model: nn.Module, params: list[torch.Tensor]) -> Iterator[Callable]:
        yield fsdp2.full_tensor

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return fsdp2.full_state_dict(model)

    def local(self, p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    def save(self, path: str, lora: bool) -> None:
        super().save(path, lora)
        for i, (model, optimizer) in enumerate(zip(self.trained, self.optimizers)):
            fsdp2.save_sharded(model, optimizer, os.path.join(path, f"fsdp2_{i}"))

    def load(self, path: str, lora: bool) -> None:
        super().load(path, lora)
        for i, (model, optimizer) in enumerate(zip(self.trained, self.optimizers)):
            fsdp2.load_sharded(model, optimizer, os.path.join(path, f"fsdp2_{i}"))


def layout_of(name: str) -> str:
    """The checkpoint layout of a sharding recorded by `name` in a checkpoint (Sharding.name)."""
    return FSDP2.layout if name == "fsdp2" else DeepSpeed.layout if name.startswith("zero") else Sharding.layout


def _frozen_names(model) -> set[str]:
    """State-dict names of the frozen parameters (every name of a tied one)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator with the run's `sharding` (see the module docstring), chosen here, once. Under an
    FSDP config accelerate is shown a plain multi-process run (models/fsdp2.py: its FSDP plugin would silently run
    DDP on CPU) and the kit shards the models itself."""

    def __init__(self, **kwargs):
        use_fsdp2 = fsdp2.enabled()
        with fsdp2.hidden_from_accelerate() if use_fsdp2 else contextlib.nullcontext():
            super().__init__(**kwargs)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and (self.num_processes == 1 or self.distributed_type.value == "NO"):
            raise RuntimeError(f"launched with WORLD_SIZE={world} but accelerate set up no distributed backend "
                               f"({self.distributed_type}); check the accelerate config")
        if use_fsdp2 and self.num_processes > 1:
            self.sharding: Sharding = FSDP2(self)
        elif self.state.deepspeed_plugin is not None:
            self.sharding = DeepSpeed(self)
        else:
            self.sharding = Sharding(self)



def uses_deepspeed() -> bool:
    """Whether this process was launched with a DeepSpeed accelerate config, before any Accelerator exists (accelerate
    launch exports it)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
