"""Starting a run: the Accelerator, with its Sharding (train/sharding.py), logging, trackers and the --output_dir
check. The same accelerate config file runs on CPU and GPU: the process group uses gloo when there is no CUDA
(accelerate and DeepSpeed otherwise disagree on the world size), and every collective carries a timeout so a lost
peer fails the run instead of hanging it."""

from __future__ import annotations

import datetime
import os

import torch

from verl_kit.config import OutputConfig, TrainConfig
from verl_kit.errors import UserError
from verl_kit.metrics import check_writable, setup_logging
from verl_kit.train.output_dir import check_output_dir
from verl_kit.train.sharding import Accelerator, uses_deepspeed


def trackers(cfg: OutputConfig) -> list[str]:
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


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """Start a run from a recipe config (TrainConfig fields): build the Accelerator (its `.sharding` chosen from the
    launch's accelerate config), set up logging (INFO on the main process) and check that --output_dir is writable
    and not another run's (output_dir.check_output_dir). Gradient accumulation is done by the recipe (token-budget
    micro-batches vary in number), so accelerate is told 1 and never rescales the loss."""
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

    cuda = torch.cuda.is_available()
    bf16 = cuda if cfg.bf16 is None else cfg.bf16
    pg = InitProcessGroupKwargs(backend="nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(
        # Without CUDA, accelerate only picks its multi-process CPU mode (gloo) when told `cpu`; otherwise a
        # MULTI_GPU config silently runs N independent single processes.
        cpu=not cuda and world > 1 and not uses_deepspeed(),
        mixed_precision="bf16" if bf16 else "no",
        gradient_accumulation_steps=1,
        kwargs_handlers=[pg] if world > 1 else [],
        log_with=trackers(cfg) or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
    )
    accelerator.sharding.configure(cfg.per_device_train_batch_size, cfg.max_grad_norm)
    set_seed(cfg.seed)
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    check_output_dir(cfg)  # a fresh run refuses another run's checkpoints, before anything loads
    return accelerator
