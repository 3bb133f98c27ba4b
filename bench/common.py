"""Shared pieces of the `bench/*_vs_trl.py` scripts: the ~20M-parameter tiny Llama, a synthetic preference dataset
with a realistic spread of lengths, subprocess and timing helpers. Benchmarks are not tests: every number they print
is a ratio against a peer (TRL) measured in the same run, on the same machine, in alternating runs."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PYTHON = sys.executable

# ~20M parameters: 6 layers of hidden 512 (8 heads of dim 64, vLLM-compatible) and MLP 1408, over the tiny BPE vocab.
MODEL_SHAPE = {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 1408}


def bench_env() -> dict:
    """Environment for every child process: offline, no trackers, no progress bars, one thread pool per process."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
                "VERL_KIT_NO_BAR": "1", "TQDM_DISABLE": "1",
                "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "DS_BUILD_OPS": "0", "PYTHONUNBUFFERED": "1"})
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # One compute thread per process: the machine is shared, and a single-threaded process's CPU time per step is
    # what it would take on an idle core, which keeps the comparison meaningful when other jobs compete for cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def build_model(out_dir: Path = RESULTS / "cache" / "tiny-llama-20m") -> str:
    """The bench model (built once, then reused): verl_kit's tiny Llama scaled up to ~20M parameters."""
    from verl_kit.models import build_tiny_model

    if not (out_dir / "config.json").is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_model(str(out_dir), **MODEL_SHAPE)
    return str(out_dir)


def count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _word_pool(tokenizer) -> list[tuple[str, int]]:
    """Words of the tiny task's vocabulary with their token counts (as ' word': the byte-level pre-tokenizer splits
    at spaces, so a text's token count is the sum of its words' counts)."""
    from verl_kit.models import tiny

    words = sorted({w.strip(",.?!") for t in tiny._corpus() for w in t.split() if w.strip(",.?!")})
    return [(w, len(tokenizer(" " + w, add_special_tokens=False)["input_ids"])) for w in words]


def _text(rng: random.Random, pool: list[tuple[str, int]], n_tokens: int) -> str:
    words, n = [], 0
    while n < n_tokens:
        w, k = rng.choice(pool)
        words.append(w)
        n += k
    return " ".join(words)


def write_preference_data(path: Path, tokenizer, n: int, seed: int = 0, prompt_median: int = 40,
                          completion_median: int = 140, sigma: float = 0.6, max_tokens: int = 1000) -> dict:
    """Write `n` conversational preference rows (explicit prompt) whose prompt and completion lengths are lognormal
    (medians in tokens, `sigma` of the underlying normal), so a prompt + completion sequence has a median of ~200
    tokens and a long right tail, like real preference data. Returns length statistics of the templated sequences."""
    rng = random.Random(seed)
    pool = _word_pool(tokenizer)
    draw = lambda median, cap: int(min(cap, max(4, rng.lognormvariate(math.log(median), sigma))))
    rows = []
    for _ in range(n):
        p = draw(prompt_median, 200)
        room = max_tokens - p
        rows.append({"prompt": [{"role": "user", "content": _text(rng, pool, p)}],
                     "chosen": [{"role": "assistant", "content": _text(rng, pool, draw(completion_median, room))}],
                     "rejected": [{"role": "assistant", "content": _text(rng, pool, draw(completion_median, room))}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lengths = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for key in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(row["prompt"] + row[key], tokenize=False)
            assert full.startswith(prompt)
            lengths.append(len(tokenizer(full, add_special_tokens=False)["input_ids"]))
    lengths.sort()
    return {"rows": n, "sequences": len(lengths), "median_tokens": statistics.median(lengths),
            "p10_tokens": lengths[len(lengths) // 10], "p90_tokens": lengths[9 * len(lengths) // 10],
            "max_tokens": lengths[-1]}


def recipe_order(n_rows: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    """Row indices of each step as a recipe run in one process reads them (verl_kit.train.distributed.step_indices): a peer
    reading, sequentially, the rows written in this order sees the same batches in the same order."""
    from verl_kit.train import step_indices

    return [step_indices(n_rows, s, batch, seed, 0, 1) for s in range(steps)]


def run(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None, prefix: str = "",
        on_line=None) -> float:
    """Run `cmd`, streaming its output (prefixed) to our stdout and to `log_path`; returns the wall time.
    `on_line(line, pid)` is called for every output line as it arrives. A non-zero exit or a timeout raises
    RuntimeError naming the command and the log file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env or bench_env(), start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                if on_line is not None:
                    on_line(line, proc.pid)
                if time.time() - t0 > timeout_s:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                print(prefix + line, end="", flush=True)
            proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"timed out after {timeout_s:.0f}s: {' '.join(cmd)} (log: {log_path})") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(cmd)} (log: {log_path})")
    return time.time() - t0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StepCPUMarks:
    """CPU seconds of each step of a recipe run: pass `on_line` to run(); the recipe logs every step right after
    timing it, so the child's CPU clock read when its `INFO step N:` line arrives closes step N (step 1's baseline is
    the recipe's step-0 line, if any). A step whose line was not seen gets NaN."""

    STEP_LINE = re.compile(r"INFO step (\d+):")

    def __init__(self):
        self.marks: dict[int, float] = {}

    def on_line(self, line: str, pid: int) -> None:
        m = self.STEP_LINE.search(line)
        if m:
            self.marks[int(m.group(1))] = process_cpu_s(pid)

    def per_step(self, steps: list[int], tag: str = "") -> list[float]:
        nan = float("nan")
        cpu = [self.marks.get(s, nan) - self.marks.get(s - 1, nan) for s in steps]
        if steps and all(c != c for c in cpu[1:]):
            print(f"WARNING: {tag}: no per-step CPU times (no 'INFO step N:' lines in the recipe's output)", flush=True)
        return cpu


def run_recipe_timed(cmd: list[str], out_dir: Path, log_path: Path, timeout_s: float, tag: str) -> dict:
    """Run a recipe that logs every step (`--logging_steps 1`); per step: step_time_s, step_cpu_s (StepCPUMarks) and
    tokens from its metrics.jsonl, plus the run's wall time and the load average before and after."""
    if os.path.exists(out_dir / "metrics.jsonl"):
        os.remove(out_dir / "metrics.jsonl")
    marks = StepCPUMarks()
    load0 = os.getloadavg()[0]
    wall = run(cmd, log_path, timeout_s, prefix=f"[{tag}] ", on_line=marks.on_line)
    with open(out_dir / "metrics.jsonl") as f:
        rows = sorted((r for r in map(json.loads, f) if "step_time_s" in r), key=lambda r: r["step"])
    return {"step_time_s": [r["step_time_s"] for r in rows], "step_cpu_s": marks.per_step([r["step"] for r in rows],
                                                                                           tag),
            "tokens": [int(r["tokens"]) for r in rows], "wall_s": wall, "loadavg_before": load0,
            "loadavg_after": os.getloadavg()[0]}


def run_trl_worker(cmd: list[str], out_json: Path, log_path: Path, timeout_s: float, tag: str) -> dict:
    """Run a TRL worker that writes its per-step figures to `out_json`; adds wall time and load averages."""
    load0 = os.getloadavg()[0]
    wall = run(cmd, log_path, timeout_s, prefix=f"[{tag}] ")
    with open(out_json) as f:
        res = json.load(f)
    return {**res, "wall_s": wall, "loadavg_before": load0, "loadavg_after": os.getloadavg()[0]}


def trl_step_timer():
    """A TrainerCallback recording the wall and process-CPU clocks at train begin and every step end; its
    `step_times()` and `step_cpu()` give each step's seconds, end to end (data fetch and collation included)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends, self.cpu = [], []

        def on_train_begin(self, args, state, control, **kw):
            self.ends, self.cpu = [time.perf_counter()], [time.process_time()]

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def step_times(self) -> list[float]:
            return [b - a for a, b in zip(self.ends, self.ends[1:])]

        def step_cpu(self) -> list[float]:
            return [b - a for a, b in zip(self.cpu, self.cpu[1:])]

    return StepTimer()


def measured(runs: list[dict], warmup: int) -> dict:
    """Medians over the measured steps of all runs of one configuration (each run: step_time_s, step_cpu_s and
    tokens per step): non-pad tokens per wall second and per CPU second (single-threaded processes, so the latter
    is the rate on an idle core)."""
    wall, cpu, times = [], [], []
    for r in runs:
        for t, c, n in list(zip(r["step_time_s"], r["step_cpu_s"], r["tokens"]))[warmup:]:
            wall.append(n / t)
            cpu.append(n / c)
            times.append(t)
    return {"tokens_per_cpu_s": median(cpu), "tokens_per_s": median(wall), "step_time_s": median(times),
            "measured_steps": len(wall), "tokens_per_cpu_s_all": cpu, "tokens_per_s_all": wall}


def loopback_netns(cmd: list[str]) -> list[str]:
    """Wrap a multi-process command in a fresh network namespace with only loopback up (root only), so the
    rendezvous and gloo can never touch a real network; unchanged when namespaces are unavailable."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return cmd
    quoted = " ".join(shlex.quote(c) for c in cmd)
    return ["unshare", "-n", "bash", "-c", f"ip link set lo up && GLOO_SOCKET_IFNAME=lo exec {quoted}"]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def save_results(name: str, results: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return path


def summary_line(name: str, ratio: float, detail: str = "") -> str:
    """The one line per comparison that bench/run.py collects: `<name> ratio=<x>` (then free text)."""
    return f"{name} ratio={ratio:.3f}" + (f"  {detail}" if detail else "")
