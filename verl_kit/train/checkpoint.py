"""Checkpoints that are atomic and resumable. Each checkpoint is written into a hidden temporary directory by every
rank (accelerate's save_state: model or DeepSpeed engine shards, optimizer, scheduler, RNG of every process), then
renamed to `checkpoint-<step>` by the main process once all ranks are done, so a run killed mid-save never leaves a
directory that `--resume_from_checkpoint auto` would pick. The data position is the step itself
(see distributed.step_indices).

A LoRA run (`--use_peft`) checkpoints what it trains: the adapter (and any trainable head, e.g. PPO's value head) with
its optimizer state, not the frozen base weights, which the resumed run loads from --model_name_or_path again (the
checkpoint records it and refuses another). SmolLM2-135M with the default adapter (r 16, every decoder
linear): 57 MB per checkpoint (adapter 20 MB + its AdamW state) instead of 570 MB.

A long run is the user's most expensive thing (docs/long-runs.md): it saves by default every
--save_interval_minutes; SIGTERM/SIGUSR1 save at the next step boundary and exit (preemption); the files are synced
before the rename and rotation comes after it; a save that fails (a full disk) stops the run in one line with the
earlier checkpoints intact; weights holding NaN or inf are never saved; a checkpoint records its run's id, rotation
deletes only this run's, and `auto` falls back to the next older checkpoint when the latest does not load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid

import torch

from verl_kit.config import DataConfig, ModelConfig, TrainConfig, flags_with_rule, resume_rules
from verl_kit.data.datasets import train_fingerprint
from verl_kit.durable import fsync_tree, remove_dir, replace_dir, sweep_deleted, write_failure
from verl_kit.errors import UserError
from verl_kit.models.loading import export_hf
from verl_kit.train.distributed import reduce_metrics
from verl_kit.train.output_dir import STATE_FILE, clear, list_checkpoints, set_aside, sweep
from verl_kit.train.preemption import StopSignal
from verl_kit.train.sharding import layout_of

logger = logging.getLogger(__name__)
# What the saved weights are (the TrainConfig flags whose resume rule is "model", config.RESUME_RULES): checked on
# their own, with no override.
MODEL_FLAGS = tuple(name for name, rule in resume_rules(TrainConfig).items() if rule == "model")


def resolve_resume(output_dir: str, resume: str | None) -> list[str]:
    """The checkpoints to try, best first: 'auto' -> every complete checkpoint of `output_dir`, newest first; a path
    -> that path, checked; nothing -> []."""
    if not resume:
        return []
    if resume == "auto":
        return [path for _, path in reversed(list_checkpoints(output_dir))]
    if not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise UserError(f"--resume_from_checkpoint {resume}: not a complete checkpoint (no {STATE_FILE})")
    return [resume]


def nonfinite_weights(accelerator) -> int:
    """How many trainable parameter tensors of the models this process's sharding prepared for training hold a NaN
    or an inf (what it holds of each: Sharding.local, e.g. ZeRO-3's partition). One pass over the weights, one sync
    per device they live on."""
    sharding = accelerator.sharding
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for model in sharding.trained:
        for p in model.parameters():
            if p.requires_grad:
                t = sharding.local(p).detach()
                by_device.setdefault(t.device, []).append(torch.isfinite(t).all().logical_not())
    return sum(int(torch.stack(flags).sum()) for flags in by_device.values())


def refuse_nonfinite(accelerator, output_dir: str, step: int, what: str) -> None:
    """Refuse, on every rank together, to write `what` from trainable weights that hold NaN or inf: one line naming
    the step and the last checkpoint, which stays the latest."""
    if reduce_metrics({}, {"nonfinite": float(nonfinite_weights(accelerator))})["nonfinite"]:
        last = list_checkpoints(output_dir)
        raise UserError(f"{what} not written: the trainable weights hold NaN or inf after step {step}; the last "
                        f"checkpoint is {last[-1][1] if last else 'none'} (docs/long-runs.md, Bad values)")


def export_final(accelerator, model, tokenizer, output_dir: str, step: int) -> str:
    """The run's trained model in HF format, `<output_dir>/final` (models.export_hf: atomic, an earlier final/ kept
    until the new one is whole), written only when every rank found its trainable weights finite after `step`
    (refuse_nonfinite): nothing non-finite is published. Returns its path."""
    refuse_nonfinite(accelerator, output_dir, step, "final/")
    path = os.path.join(output_dir, "final")
    export_hf(accelerator, model, accelerator.sharding.full_state_dict(model), tokenizer, path)
    return path


class _Failure:
    """What went wrong on this rank while writing a checkpoint: a write failure's reason (no space, permission, an
    I/O error: one line), or an error of another kind (a bug, in DeepSpeed's or FSDP2's save or ours), which this
    rank raises once every rank has agreed to stop; '' / None while all is well."""

    def __init__(self):
        self.reason, self.error = "", None

    def note(self, e: Exception, output_dir: str) -> None:
        reason = write_failure(e, output_dir)
        if reason is None:
            self.error, reason = e, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.reason = reason


def _agree(failure: _Failure, what: str, output_dir: str, tmp: str, is_main: bool) -> None:
    """Every rank stops together when writing `what` failed on any (one all-reduce: a rank whose save raised never
    leaves the others waiting in a collective): the temporary `tmp` is removed, the checkpoints already on disk are
    left as they are and stay the latest, and each rank ends in one line, but the rank whose error was a bug, which
    raises it (its traceback)."""
    if not reduce_metrics({}, {"failed": float(bool(failure.reason))})["failed"]:
        return
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure.error is not None:
        raise failure.error
    kept = ", ".join(os.path.basename(p) for _, p in list_checkpoints(output_dir)) or "none"
    raise UserError(f"--output_dir {output_dir}: writing {what} failed ({failure.reason or 'on another process'}); "
                    f"the run stops and the checkpoints on disk are intact ({kept}): free space, then continue with "
                    "--resume_from_checkpoint auto")


def _room(output_dir: str) -> str:
    """'' when the device of `output_dir` has room for another checkpoint as large as the latest (10% more, and 1 MiB),
    else why not. Checked by every rank before anything is written: a rank whose disk fills inside DeepSpeed's save
    can leave the others waiting in its barrier, so the common case (the disk was already too full) never starts.
    Without a checkpoint yet, nothing to go by: the write itself is the check."""
    last = list_checkpoints(output_dir)
    if not last:
        return ""
    size = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(last[-1][1])
               for name in names)
    need, free = int(size * 1.1) + (1 << 20), shutil.disk_usage(output_dir).free
    if free >= need:
        return ""
    return f"{need / 2**20:.1f} MiB needed (the latest checkpoint is {size / 2**20:.1f} MiB), {free / 2**20:.1f} MiB " \
           "free on the device"


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, model: dict, run_id: str, per_rank=None,
                    run: dict | None = None, extra: dict | None = None) -> str:
    """Checkpoint `step` of run `run_id` (`model`: the MODEL_FLAGS values, checked on resume; `run`:
    run_fingerprint's data hash and maths flags, compared on resume), keeping the last `keep` of this run's
    checkpoints (the ones recording `run_id`: Checkpoints.run_id); `extra`: more of the trainer state (the token
    budget --max_tokens_per_microbatch auto chose). `per_rank`: an object with
    state_dict()/load_state_dict() whose state differs between processes (saved by each, as rank-<i>.pt;
    accelerate's custom objects are saved by the main process only). Every rank first checks that its trainable
    weights are finite (refused in one line otherwise) and that its device has room (_room); the files are written
    into `.tmp-checkpoint-<step>`, synced with their directory, renamed to `checkpoint-<step>` (trainer_state.json,
    the marker, last, by the main process once every rank reported success), and only then are older checkpoints
    deleted. A write that fails on any rank (no space, permission, an error inside DeepSpeed's or FSDP2's save)
    stops every rank (_agree), removes the temporary and leaves the earlier checkpoints, the latest still latest."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    refuse_nonfinite(accelerator, output_dir, step, f"checkpoint-{step}")
    failure = _Failure()
    failure.reason = _room(output_dir)
    _agree(failure, f"checkpoint-{step}", output_dir, tmp, accelerator.is_main_process)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.sharding.save(tmp, lora=bool(model.get("use_peft")))
        if per_rank is not None:
            torch.save(per_rank.state_dict(), os.path.join(tmp, f"rank-{accelerator.process_index}.pt"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a full disk, a permission, a bug in a save (DCP's CheckpointException is a
        failure.note(e, output_dir)  # BaseException): every rank learns it in _agree
    _agree(failure, f"checkpoint-{step}", output_dir, tmp, accelerator.is_main_process)
    if accelerator.is_local_main_process and not accelerator.is_main_process:
        try:  # the other nodes' writes reach their devices before the main process renames (it syncs its own)
            fsync_tree(tmp)
        except OSError as e:
            failure.note(e, output_dir)
    _agree(failure, f"checkpoint-{step}", output_dir, tmp, accelerator.is_main_process)
    if accelerator.is_main_process:  # the commit: trainer_state.json (the marker) written last, then the rename
        try:
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({"step": step, "run_id": run_id, "model": model, **({"run": run} if run else {}),
                           **(extra or {})}, f)
            replace_dir(tmp, final)  # fsync of every file and directory (trainer_state.json too), then the rename
        except Exception as e:
            failure.note(e, output_dir)
    _agree(failure, f"checkpoint-{step}", output_dir, tmp, accelerator.is_main_process)
    if accelerator.is_main_process:
        mine = [path for _, path in list_checkpoints(output_dir) if _run_id(path) in (run_id, None)]
        for old in mine[:-keep] if keep > 0 else []:
            remove_dir(old)  # whole or gone: a kill midway never leaves a checkpoint without its marker
        sweep_deleted(output_dir)
        logger.info("saved %s", final)
    accelerator.wait_for_everyone()
    return final


def _run_id(path: str) -> str | None:
    """The run id a checkpoint records (None: saved before run ids, or unreadable)."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


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
    accelerator.sharding.load(path, lora=bool(model.get("use_peft")))
    rank_file = os.path.join(path, f"rank-{accelerator.process_index}.pt")
    if per_rank is not None and os.path.isfile(rank_file):
        per_rank.load_state_dict(torch.load(rank_file))
    logger.info("resumed from %s at step %d", path, state["step"])
    return state


class PerRank:
    """Several objects whose state differs between processes, as one `per_rank` (their states by name in the rank
    file); None objects are left out."""

    def __init__(self, **objects):
        self.objects = {name: obj for name, obj in objects.items() if obj is not None}

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(self.objects.keys() - state.keys())
        if missing:
            raise UserError(f"the checkpoint's per-process state holds no {missing} (saved by another kind of run)")
        for name, obj in self.objects.items():
            obj.load_state_dict(state[name])


class Checkpoints:
    """A run's checkpoints, held by the recipe from its start to its end:

        ckpt = train.Checkpoints(accelerator, cfg.train, flags, per_rank=rollouts)
        start = ckpt.resume()                       # 0, or the step a checkpoint continues from
        for step in range(start, total_steps):
            ...
            if stop := ckpt.save_if_due(step + 1):  # a stop signal: saved, leave the loop
                break

    It owns what a run is on disk: its id (recorded in each checkpoint; a resumed run keeps the id of the checkpoint
    it resumed, and rotation deletes only this run's), the clock of --save_interval_minutes, and the stop signal
    (train/preemption.py). `flags`: the run's flags a resume compares (config.Args.resume_checked);
    `per_rank`: an object with state_dict()/load_state_dict() whose state differs between processes (Rollouts)."""

    def __init__(self, accelerator, cfg: TrainConfig, flags: dict, per_rank=None):
        self.accelerator, self.cfg, self.flags, self.per_rank = accelerator, cfg, flags, per_rank
        self.run_id = uuid.uuid4().hex[:12]
        self.last_save = time.monotonic()
        self.stop = StopSignal()

    def fingerprint(self) -> dict:
        return run_fingerprint(self.cfg, self.flags, self.accelerator.sharding.name)

    def resume(self) -> int:
        """The run's start on disk, before its first step:
        1. what an interrupted save left is swept (output_dir.sweep); a fresh run with --overwrite_output_dir deletes
           the earlier run's checkpoints and final/ (without it make_accelerator has refused a used --output_dir);
        2. `--resume_from_checkpoint` ('auto' or a path): every prepared model, optimizer, scheduler and RNG (and
           `per_rank`'s state) is restored, after checking that the run's model, data and maths flags are the
           checkpoint's; under --max_tokens_per_microbatch auto the checkpoint's token budget is kept. With 'auto', a
           checkpoint that does not load (a truncated shard) is skipped for the next older one, with a warning.
           Checkpoints newer than the one resumed are moved to <output_dir>/superseded/, so that a later 'auto' never
           returns to them;
        3. from here on SIGTERM and SIGUSR1 save at the next step boundary and exit (save_if_due), and the clock of
           --save_interval_minutes starts.
        Returns the step to continue from, 0 when there is nothing to resume."""
        accelerator, cfg = self.accelerator, self.cfg
        if accelerator.is_main_process:
            sweep(cfg.output_dir)
            if cfg.overwrite_output_dir:
                clear(cfg.output_dir)
        accelerator.wait_for_everyone()
        path, state = self._restore()
        if accelerator.is_main_process and path:
            newer = [p for s, p in list_checkpoints(cfg.output_dir)
                     if s > state["step"] or s == state["step"] and os.path.realpath(p) != os.path.realpath(path)]
            for p in set_aside(cfg.output_dir, newer):
                logger.warning("resumed from %s: the newer %s is moved aside to %s (never resumed; delete it when "
                               "not needed)", path, os.path.basename(p).split(".")[0], p)
        accelerator.wait_for_everyone()
        self.run_id = (state or {}).get("run_id") or self.run_id
        if state and "token_budget" in state and cfg.max_tokens_per_microbatch == "auto":
            if state["token_budget"] != cfg.token_budget and accelerator.is_main_process:
                logger.info("--max_tokens_per_microbatch auto: %s keeps its budget %s (the plan chose %s now)", path,
                            state["token_budget"], cfg.token_budget)
            cfg.chosen_token_budget = state["token_budget"]  # the same micro-batches: the same sums
        self.last_save = time.monotonic()
        self.stop.arm(announce=accelerator.is_main_process)
        return state["step"] if state else 0

    def _restore(self) -> tuple[str | None, dict | None]:
        """Load the first checkpoint of resolve_resume that loads on every rank -> (its path, its trainer state), or
        (None, None) when there is none. A model, data or flag mismatch (UserError) stops the run; any other failure
        to load moves on to the next older checkpoint ('auto' only)."""
        cfg = self.cfg
        paths = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
        failures = []
        for i, path in enumerate(paths):
            failure = ""
            try:
                state = load_checkpoint(self.accelerator, path, model_flags(cfg), self.per_rank, self.fingerprint(),
                                        cfg.resume_ignore_changes)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: what the fallback is for
                failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if cfg.resume_from_checkpoint != "auto":
                    raise
            if not reduce_metrics({}, {"failed": float(bool(failure))})["failed"]:
                return path, state
            failures.append(f"{os.path.basename(path)}: {failure or 'failed on another process'}")
            logger.warning("--resume_from_checkpoint auto: %s does not load (%s); %s", path,
                           failure or "failed on another process",
                           f"trying {paths[i + 1]}" if i + 1 < len(paths) else "no older checkpoint")
        if failures:
            raise UserError(f"--resume_from_checkpoint auto: no checkpoint in {cfg.output_dir} loads "
                            f"({'; '.join(failures)})")
        return None, None

    def save(self, step: int) -> str:
        """Checkpoint `step` now (save_checkpoint), keeping --save_total_limit of this run's checkpoints."""
        auto = self.cfg.max_tokens_per_microbatch == "auto"
        path = save_checkpoint(self.accelerator, self.cfg.output_dir, step, self.cfg.save_total_limit,
                               model_flags(self.cfg), self.run_id, self.per_rank, self.fingerprint(),
                               {"token_budget": self.cfg.token_budget} if auto else None)
        self.last_save = time.monotonic()
        return path

    def save_if_due(self, step: int) -> int:
        """The end of optimizer step `step`, on every rank. Checkpoints when it is due: every `--save_steps`, once
        `--save_interval_minutes` have passed since the last checkpoint (or the start), or when a stop signal reached
        any rank (preemption). Returns the stop signal's number once it is saved (the same on every rank), else 0:
        the recipe then leaves its loop, skips its export and ends with train.destroy(stop). One small collective
        per step, so that every rank decides alike."""
        cfg = self.cfg
        by_time = cfg.save_interval_minutes > 0 and time.monotonic() - self.last_save >= 60 * cfg.save_interval_minutes
        agreed = reduce_metrics({}, {"stop": float(self.stop.received), "time": float(by_time)})
        stop = int(agreed["stop"])
        if stop or agreed["time"] or cfg.save_steps and step % cfg.save_steps == 0:
            path = self.save(step)
            if stop and self.accelerator.is_main_process:
                print(f"stopped by {signal.Signals(stop).name} after step {step}: saved {path}; continue with "
                      "--resume_from_checkpoint auto", file=sys.stderr, flush=True)
        return stop


def run_fingerprint(cfg: DataConfig, flags: dict, sharding: str = "none") -> dict:
    """What a resumed run must share with the checkpoint to continue the same training: `data`, the content hash of
    the train split (data.split_fingerprint: the rows, in order, whatever the file is called), `flags`, the flags
    whose field's resume rule is "checked" (config.Args.resume_checked; the "model" ones are checked on their own,
    the "free" ones not at all), JSON values, and `sharding` (Sharding.name: the backend that wrote the model and
    optimizer files)."""
    source = (" + ".join(f"{d.path} {d.split}" for d in cfg.datasets) if cfg.datasets
              else f"{cfg.dataset_name} {cfg.dataset_train_split}")
    return {"data": train_fingerprint(cfg), "data_source": source, "flags": json.loads(json.dumps(flags)),
            "sharding": sharding}


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
    if "sharding" in saved and layout_of(saved["sharding"]) != layout_of(now["sharding"]):
        out.append(f"the sharding ({saved['sharding']} -> {now['sharding']}: the accelerate config; its model and "
                   "optimizer files do not load under the other)")
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


def model_flags(cfg: ModelConfig) -> dict:
    """The values of the flags that say what the saved weights are (resume rule "model")."""
    return flags_with_rule(cfg, "model")
