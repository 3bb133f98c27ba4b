"""PyTorch FSDP2 (`fully_shard`, DTensor parameters), the second sharding backend beside DeepSpeed ZeRO-3, chosen by
`accelerate launch --config_file accelerate_configs/fsdp2.yaml`. The one home of what FSDP2 changes: which run uses
it, sharding a model, and gathering full tensors (export, weight sync).

The kit applies `fully_shard` itself rather than through accelerate's FSDP plugin: accelerate 1.15 turns an FSDP
config into DistributedType.FSDP only on accelerator devices (state.py upgrades MULTI_GPU/NPU/XPU..., never
MULTI_CPU), so on CPU the same config silently ran plain DDP. Applied here, the one code path runs on CPU (gloo) and
on GPU (NCCL), and the CPU tests exercise what a GPU run executes. Accelerate then sees a plain multi-process run."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from verl_kit.errors import UserError

# fsdp_config keys the kit does not implement, each refused in one line rather than silently ignored
_REFUSED = {"FSDP_OFFLOAD_PARAMS": "fsdp_offload_params true: the kit's FSDP2 keeps parameters on the device; for CPU "
                                   "offload use accelerate_configs/zero3_offload.yaml",
            "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing true: use the recipe's "
                                             "--gradient_checkpointing true instead"}


def enabled() -> bool:
    """Whether this process was launched with an FSDP accelerate config (accelerate launch exports the yaml's
    fsdp_config as FSDP_* variables). FSDP1, parameter offload and FSDP's own activation checkpointing are refused
    in one line. fsdp_state_dict_type is read as the kit does it: checkpoints are always sharded (torch distributed
    checkpointing), exports always full; fsdp_cpu_ram_efficient_loading: see `ram_efficient_loading`."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return False
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise UserError(f"accelerate config: fsdp_version {version} is not supported; the kit shards with FSDP2 "
                        "(fsdp_version: 2, see accelerate_configs/fsdp2.yaml)")
    for var, why in _REFUSED.items():
        if os.environ.get(var, "false").lower() == "true":
            raise UserError(f"accelerate config: {why}")
    return True


def ram_efficient_loading() -> bool:
    """fsdp_cpu_ram_efficient_loading: true (TRL's fsdp2.yaml sets it). transformers' from_pretrained then reads the
    checkpoint on each node's local rank 0 only and gives every other process zeros of the same shapes
    (transformers.distributed.fsdp.is_fsdp_enabled), or the kit's loaders build it empty there (`builds_empty`);
    `shard` then fills every process's shards from rank 0."""
    return os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true"


def builds_empty() -> bool:
    """Whether this process builds the models it shards empty, on the meta device, instead of reading their
    checkpoint: under `ram_efficient_loading`, every process but rank 0 (`shard` broadcasts rank 0's weights)."""
    return (ram_efficient_loading() and enabled() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1 and torch.distributed.get_rank() != 0)


@contextlib.contextmanager
def hidden_from_accelerate():
    """Build the Accelerator inside this block: it then sets up a plain multi-process run (gloo on CPU, NCCL on GPU)
    and never wraps a model in its own FSDP; the FSDP_* variables stay for `enabled` and `shard`."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def _layer_classes(model: nn.Module) -> set[str]:
    """The transformer-layer classes to wrap: fsdp_transformer_layer_cls_to_wrap when given, else every
    `_no_split_modules` of the HF models inside `model` (what accelerate's TRANSFORMER_BASED_WRAP picks)."""
    named = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if named:
        return {c.strip() for c in named.split(",") if c.strip()}
    return {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or [])}


def shard(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """Shard `model` in place over all processes: one FSDP unit per transformer layer, then the root (embeddings,
    final norm, LM head: a tied head stays one parameter), resharded after forward unless the config says
    fsdp_reshard_after_forward false. `bf16`: compute in bf16, reduce gradients in fp32 (the parameters and the
    optimizer state stay fp32). Every process must then run the same forward passes, as under ZeRO-3. Gradients are
    averaged over the processes, as DDP averages them. Under `ram_efficient_loading` the weights and buffers are
    rank 0's (the other processes loaded zeros, or built the model on the meta device), broadcast into the shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    classes = _layer_classes(model)
    if not classes:
        raise UserError(f"FSDP2: {type(model).__name__} names no transformer layer to wrap (_no_split_modules); set "
                        "fsdp_transformer_layer_cls_to_wrap in the accelerate config")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    from_rank0 = ram_efficient_loading() and torch.distributed.get_world_size() > 1
    full = model.state_dict() if from_rank0 and torch.distributed.get_rank() == 0 else {}
    # No model.to(device) first: fully_shard moves each unit's parameters and buffers to the mesh's device as it
    # shards it, so a GPU never holds more than one unsharded layer (the root's embeddings and head last).
    for m in list(model.modules()):
        if type(m).__name__ in classes:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    if any(p.is_meta for p in model.parameters()):  # built empty: this process's shards allocated, then filled
        if not from_rank0:
            raise RuntimeError("FSDP2: a model built on the meta device, without weights to broadcast")
        model.to_empty(device=device)
    if from_rank0:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in model.buffers():  # not sharded; the non-persistent ones (rotary frequencies) are in no state dict
            torch.distributed.broadcast(buffer, 0)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every process calls it, in the same order); any other tensor as
    it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model on the main process, on CPU ({} elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # A LoRA run checkpoints what it trains (the base weights come from --model_name_or_path again)
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """The trained parameters and optimizer state of a sharded model into the folder `path` with torch distributed
    checkpointing: every process writes its own shards (no gather), `.metadata` last. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Restore what save_sharded wrote into the same sharding (each process reads its shards; a name the
    checkpoint lacks raises). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # get_state_dict fills an unstepped optimizer's moments with zeros first, so that there are slots to load into
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options())
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_options())
