"""Checkpoints that are atomic and resumable. Each checkpoint is written into a hidden temporary directory by every
rank (accelerate's save_state: model or DeepSpeed engine shards, optimizer, scheduler, RNG of every process), then
renamed to `checkpoint-<step>` by the main process once all ranks are done, so a run killed mid-save never leaves a
directory that `--resume_from_checkpoint auto` would pick. The data position is the step itself
(see distributed.step_indices).

A LoRA run (`--use_peft`) checkpoints what it trains: the adapter (and any trainable head, e.g. PPO's value head) with
its optimizer state, not the frozen base weights, which the resumed run loads from --model_name_or_path again (the
checkpoint records it and refuses another). SmolLM2-135M with the default adapter (r 16, every decoder
linear): 57 MB per checkpoint (adapter 20 MB + its AdamW state) instead of 570 MB."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil

from verl_kit.config import TrainConfig
from verl_kit.data.datasets import split_fingerprint
from verl_kit.errors import UserError

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
# What the saved weights are: a checkpoint resumed under other values would load its base weights and adapter into a
# run that means another model (or fail deep inside load_state on mismatched shapes).
MODEL_FLAGS = ("model_name_or_path", "use_peft", "lora_r", "lora_target_modules")
# What a resume may change freely: where the run writes, how often it logs, evaluates or saves, how long it waits,
# how it evaluates, and how it splits or runs the same sums (micro-batches, packing, engine memory). Every other flag
# of the recipe's config changes the maths: the checkpoint records its value and a resume with another value is
# refused (--resume_ignore_changes overrides). A flag added later is checked unless it is listed here.
FREE_FLAGS = frozenset({
    "output_dir", "resume_from_checkpoint", "resume_ignore_changes", "max_steps", "num_train_epochs", "logging_steps",
    "eval_steps", "save_steps", "save_total_limit", "report_to", "run_name", "collective_timeout_s",
    "per_device_eval_batch_size", "dataset_test_split", "gradient_checkpointing", "attn_implementation", "packing",
    "packing_length", "max_tokens_per_microbatch", "num_generations_eval", "pass_threshold", "rollout_timeout_s",
    "reward_timeout_s", "reward_max_concurrency", "vllm_server_url", "vllm_gpu_memory_utilization",
    "vllm_max_num_seqs", "vllm_enable_sleep_mode", "vllm_kv_cache_gib", "vllm_sync_bucket_mb", "vllm_sync_timeout_s",
    "vllm_weight_sync_transport", "vllm_probe_size", "vllm_probe_threshold",
    "dataset_name", "dataset_config", "dataset_train_split"})  # the data itself is compared by its rows' hash


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume(output_dir: str, resume: str | None) -> str | None:
    """'auto' -> latest complete checkpoint or None; a path -> that path, checked."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    if not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise UserError(f"--resume_from_checkpoint {resume}: not a complete checkpoint (no {STATE_FILE})")
    return resume


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, model: dict, per_rank=None,
                    run: dict | None = None) -> str:
    """Checkpoint `step` (`model`: the MODEL_FLAGS values, checked on resume; `run`: run_fingerprint's data hash and
    maths flags, compared on resume), keeping the last `keep`. `per_rank`:
    an object with state_dict()/load_state_dict() whose state differs between processes (saved by each, as
    rank-<i>.pt; accelerate's custom objects are saved by the main process only)."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    with _frozen_left_out(accelerator, model.get("use_peft")) as kwargs:
        accelerator.save_state(tmp, **kwargs)
    if per_rank is not None:
        import torch

        torch.save(per_rank.state_dict(), os.path.join(tmp, f"rank-{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({"step": step, "model": model, **({"run": run} if run else {})}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for _, old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved %s", final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str, model: dict, per_rank=None, run: dict | None = None,
                    ignore_changes: bool = False) -> dict:
    """Restore model, optimizer, scheduler and RNG; returns the trainer state (step, ...). Refuses, before loading
    anything, a checkpoint of another model (`model`: this run's MODEL_FLAGS values), and one saved from other data
    or with other maths flags (`run`: this run's run_fingerprint; `ignore_changes`: warn instead)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    for flag, value in state.get("model", {}).items():
        if model.get(flag) != value:
            raise UserError(f"--resume_from_checkpoint {path}: saved with --{flag} {value}, this run has --{flag} "
                            f"{model.get(flag)}")
    if run is not None:
        check_run(path, state.get("run"), run, ignore_changes)
    with _frozen_left_out(accelerator, model.get("use_peft"), loading=path) as kwargs:
        accelerator.load_state(path, **kwargs)
    rank_file = os.path.join(path, f"rank-{accelerator.process_index}.pt")
    if per_rank is not None and os.path.isfile(rank_file):
        import torch

        per_rank.load_state_dict(torch.load(rank_file))
    logger.info("resumed from %s at step %d", path, state["step"])
    return state


def _frozen_names(model) -> set[str]:
    """State-dict names of the frozen parameters (every name of a tied one)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


@contextlib.contextmanager
def _frozen_left_out(accelerator, active: bool, loading: str | None = None):
    """Yields accelerate's save_state (or, `loading` a checkpoint, load_state) keyword arguments that leave frozen
    parameters out when `active`. DeepSpeed engines do it themselves (exclude_frozen_parameters on save; a
    non-strict module load, the trainable values coming back from the optimizer's partitions); for plain models a
    pre-hook drops them from the saved weights, and on load the saved names must be exactly the trainable ones
    before the model is loaded non-strictly."""
    from accelerate.utils import SAFE_MODEL_NAME, DistributedType

    if not active:
        yield {}
        return
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        yield {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}
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
                raise UserError(f"--resume_from_checkpoint {loading}: {os.path.basename(file)} does not hold this "
                                f"run's trainable weights (missing {sorted(expected - saved)[:3]}, unexpected "
                                f"{sorted(saved - expected)[:3]})")

    handle = (accelerator.register_load_state_pre_hook(check) if loading
              else accelerator.register_save_state_pre_hook(drop))
    try:
        yield {"strict": False} if loading else {}
    finally:
        handle.remove()


def resume(accelerator, cfg: TrainConfig, flags: dict, per_rank=None) -> int:
    """`--resume_from_checkpoint` ('auto' or a path): restore every prepared model, optimizer, scheduler and RNG from
    it (and `per_rank`'s state: save_checkpoint), after checking that the run's model, data and maths flags (`flags`:
    every flag of the run, config.Args.flags) are the checkpoint's. Returns the step to continue from, 0 when there
    is nothing to resume."""
    path = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    if not path:
        return 0
    return load_checkpoint(accelerator, path, model_flags(cfg), per_rank, run_fingerprint(cfg, flags),
                           cfg.resume_ignore_changes)["step"]


def save_if_due(accelerator, cfg: TrainConfig, step: int, flags: dict, per_rank=None) -> None:
    """Checkpoint after optimizer step `step` every `--save_steps` (0: never), keeping `--save_total_limit`;
    `flags`: every flag of the run (config.Args.flags), recorded for the resume check."""
    if cfg.save_steps and step % cfg.save_steps == 0:
        save_checkpoint(accelerator, cfg.output_dir, step, cfg.save_total_limit, model_flags(cfg), per_rank,
                        run_fingerprint(cfg, flags))


def run_fingerprint(cfg: TrainConfig, flags: dict) -> dict:
    """What a resumed run must share with the checkpoint to continue the same training: `data`, the content hash of
    the train split (data.split_fingerprint: the rows, in order, whatever the file is called), and `flags`, every
    flag of the run (`flags`) but MODEL_FLAGS (checked on their own) and FREE_FLAGS, JSON values."""
    kept = {k: v for k, v in flags.items() if k not in FREE_FLAGS and k not in MODEL_FLAGS}
    return {"data": split_fingerprint(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config),
            "data_source": f"{cfg.dataset_name} {cfg.dataset_train_split}", "flags": json.loads(json.dumps(kept))}


def run_changes(saved: dict | None, now: dict) -> list[str]:
    """What differs between a checkpoint's run_fingerprint and this run's, one phrase each ([] for a checkpoint saved
    before fingerprints existed). A flag the checkpoint did not record (added to the kit since) is not compared: its
    default reproduces the older numbers."""
    if not saved:
        return []
    out = []
    if saved.get("data") != now["data"]:
        out.append(f"the training data ({saved.get('data_source')} rows hash {saved.get('data')} -> "
                   f"{now['data_source']} {now['data']})")
    out += [f"--{k} {v} -> {now['flags'].get(k)}" for k, v in saved.get("flags", {}).items()
            if k in now["flags"] and now["flags"][k] != v]
    return out


def check_run(path: str, saved: dict | None, now: dict, ignore_changes: bool) -> list[str]:
    """Refuse, in one line naming what changed and the override, to resume checkpoint `path` (its run_fingerprint
    `saved`) into a run with another fingerprint `now`; with `ignore_changes`, warn instead. Returns the changes."""
    changes = run_changes(saved, now)
    if changes and not ignore_changes:
        raise UserError(f"--resume_from_checkpoint {path}: changed since the checkpoint: {'; '.join(changes)} "
                        "(resume anyway with --resume_ignore_changes)")
    if changes:
        logger.warning("resuming %s with --resume_ignore_changes: %s", path, "; ".join(changes))
    return changes


def model_flags(cfg: TrainConfig) -> dict:
    return {flag: getattr(cfg, flag) for flag in MODEL_FLAGS}
