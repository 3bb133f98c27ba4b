"""What a run's `--output_dir` holds and whose it is. A run owns its directory: its checkpoints (`checkpoint-<step>`,
each recording the run's id in trainer_state.json), `final/`, metrics.jsonl and samples.jsonl. A fresh run refuses a
directory that holds another run's checkpoints or final model (check_output_dir, called by make_accelerator before
anything loads); a resumed run continues the run it resumes. Nothing here needs a process group: every rank reads
the same directory and takes the same decision, and only the main process changes it (checkpoint.resume)."""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil

from verl_kit.config import OutputConfig
from verl_kit.durable import sweep_aside
from verl_kit.errors import UserError

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
FINAL = "final"
SUPERSEDED = "superseded"  # checkpoints newer than the one a run resumed from, kept for the user, never resumed
_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `output_dir` (trainer_state.json is written last), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def check_output_dir(cfg: OutputConfig) -> None:
    """A fresh run (no --resume_from_checkpoint) refuses, in one line, an --output_dir that holds another run's
    checkpoints or final model: it would rotate them away, truncate their metrics and replace their final/.
    --overwrite_output_dir lets it (checkpoint.resume then deletes them)."""
    if cfg.resume_from_checkpoint or cfg.overwrite_output_dir:
        return
    held = [os.path.basename(p) for _, p in list_checkpoints(cfg.output_dir)]
    if os.path.isdir(os.path.join(cfg.output_dir, FINAL)):
        held.append(f"{FINAL}/")
    if held:
        shown = ", ".join(held if len(held) <= 3 else ["...", *held[-3:]])
        raise UserError(f"--output_dir {cfg.output_dir} holds another run's work ({shown}): continue that run with "
                        "--resume_from_checkpoint auto, replace it with --overwrite_output_dir, or choose another "
                        "--output_dir")


def sweep(output_dir: str) -> None:
    """Remove what a crashed or killed save left: temporary checkpoints and exports (durable.replace_dir)."""
    for tmp in glob.glob(os.path.join(glob.escape(output_dir), ".tmp-checkpoint-*")) + \
            [os.path.join(output_dir, f"{FINAL}.tmp")]:
        if os.path.exists(tmp):
            logger.info("removing %s, left by an interrupted save", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    for old in glob.glob(os.path.join(glob.escape(output_dir), "checkpoint-*.old")) + [f"{FINAL}.old"]:
        sweep_aside(os.path.join(output_dir, os.path.basename(old).removesuffix(".old")))


def clear(output_dir: str) -> None:
    """--overwrite_output_dir: delete the earlier run's checkpoints, final model and superseded checkpoints."""
    gone = [p for _, p in list_checkpoints(output_dir)] + [os.path.join(output_dir, n) for n in (FINAL, SUPERSEDED)]
    gone = [p for p in gone if os.path.exists(p)]
    for path in gone:
        shutil.rmtree(path)
    if gone:
        logger.warning("--overwrite_output_dir: deleted the earlier run's %s",
                       ", ".join(os.path.basename(p) for p in gone))


def set_aside(output_dir: str, paths: list[str]) -> list[str]:
    """Move checkpoints `paths` into <output_dir>/superseded/ (a name taken gets a numbered suffix), where
    list_checkpoints never looks. Returns the new paths."""
    if not paths:
        return []
    aside = os.path.join(output_dir, SUPERSEDED)
    os.makedirs(aside, exist_ok=True)
    moved = []
    for path in paths:
        target = os.path.join(aside, os.path.basename(path))
        n = 1
        while os.path.exists(target):
            target, n = os.path.join(aside, f"{os.path.basename(path)}.{n}"), n + 1
        os.rename(path, target)
        moved.append(target)
    return moved
