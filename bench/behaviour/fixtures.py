"""Fixtures shared by every tree's runs (built once, by the first tree that needs them; then reused as files):

teacher     the tiny model after 20 SFT steps of recipes/configs/sft_tiny.yaml: the distillation teacher.
toolcaller  the tiny model after SFT on 64 warm-start traces of envs.py:TRLStyleEnv (Episodes.trace: the tools in
            the system message, the assistant writes <tool_call>{"name": "lookup", ...}</tool_call>, the tool's
            result comes back, the assistant answers "It is kind." and ends its turn): a policy that calls the tool
            and ends turns, so that the tool path, multi-turn episodes and merged agent calls are exercised.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIX = HERE / "fixtures"
TEACHER = FIX / "teacher"
TOOLCALLER = FIX / "toolcaller"



def _sft(tree: Path, env: dict, python: str, out: Path, args: list[str]) -> None:
    tmp = FIX / (out.name + "-run")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [python, "recipes/sft.py", "--config", "recipes/configs/sft_tiny.yaml", "--dataset_test_split", "none",
           "--seed", "42", "--output_dir", str(tmp), *args]
    p = subprocess.run(cmd, cwd=tree, env={**env, "WANDB_DIR": str(tmp)}, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"fixture {out.name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tmp / "final", out)
    shutil.rmtree(tmp)


def build(tree: Path, env: dict, python: str) -> None:
    FIX.mkdir(exist_ok=True)
    if not (TEACHER / "model.safetensors").is_file():
        print(f"building fixture {TEACHER} with {tree} (once)", flush=True)
        _sft(tree, env, python, TEACHER, ["--max_steps", "20", "--logging_steps", "10"])
    if not (TOOLCALLER / "model.safetensors").is_file():
        print(f"building fixture {TOOLCALLER} with {tree} (once)", flush=True)
        data = FIX / "toolcaller_traces"
        data.mkdir(exist_ok=True)
        subprocess.run([python, str(HERE / "traces.py"), str(data / "train.jsonl")], cwd=tree, env=env,
                       check=True, capture_output=True)
        _sft(tree, env, python, TOOLCALLER, ["--dataset_name", str(data), "--max_steps", "120", "--logging_steps",
                                             "20", "--learning_rate", "0.003", "--lr_scheduler_type", "constant",
                                             "--max_length", "512", "--max_prompt_length", "400",
                                             "--packing_length", "1024"])
