"""Shared test helpers: run recipes as subprocesses, launch them under accelerate inside a loopback-only network
namespace, read their metrics and exported weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCELERATE = str(BIN / "accelerate")


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", GLOO_SOCKET_IFNAME="lo", VERL_KIT_NO_BAR="1",
             TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def isolated(cmd: list[str]) -> list[str]:
    """Run `cmd` in a fresh loopback-only network namespace when we can (root), so gloo and accelerate can only
    reach 127.0.0.1. Otherwise run it as is."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        quoted = " ".join(f"'{c}'" for c in cmd)
        return ["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {quoted}"]
    return cmd


def recipe_cmd(recipe: str, args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "recipes" / recipe), *args]


def launch_cmd(config: str, nproc: int, recipe: str, args: list[str], extra: list[str] = ()) -> list[str]:
    return launch_script(config, nproc, str(REPO / "recipes" / recipe), args, extra)


def launch_script(config: str, nproc: int, script: str, args: list[str], extra: list[str] = ()) -> list[str]:
    """`accelerate launch` of any script under one of accelerate_configs/, in a loopback-only namespace."""
    return isolated([ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / config),
                     "--num_processes", str(nproc), "--main_process_port", "29533", *extra, script, *args])


def run(cmd: list[str], timeout: float = 300, check: bool = True, **env_extra) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=env(OMP_NUM_THREADS=1, **env_extra), capture_output=True, text=True,
                       timeout=timeout, start_new_session=True)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(cmd)}\n--- stderr tail ---\n{p.stderr[-4000:]}")
    return p


def run_until(cmd: list[str], done, timeout: float = 300, **env_extra) -> None:
    """Start `cmd`, wait until `done()` is true, then SIGKILL its whole process group (a crash, not a shutdown)."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env(OMP_NUM_THREADS=1, **env_extra), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while not done():
            if p.poll() is not None:
                raise AssertionError(f"exited early ({p.returncode}): {p.stderr.read()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError("timed out waiting for the condition")
            time.sleep(0.02)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def metrics(output_dir) -> list[dict]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))
