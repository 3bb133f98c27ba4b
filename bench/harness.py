"""The one harness of the `bench/<name>_vs_<peer>.py` comparisons (bench/README.md has the method): the bench model and
data, subprocess and CPU-clock helpers, the offline comparisons' alternating rounds, the TRL worker side, the online
step-time comparisons and the per-rank model-state worker (`python bench/harness.py state-worker ...` under
`accelerate launch`). Every number a bench prints is a ratio against a peer measured in the same run."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PYTHON = sys.executable

# ~20M parameters: 6 layers of hidden 512 (8 heads of dim 64, vLLM-compatible) and MLP 1408, over the tiny BPE vocab.
MODEL_SHAPE = {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 1408}
# The offline comparisons' hyper-parameters (recipe flags and TRL config alike) and the LoRA of lora_vs_full.py.
HYPER = {"learning_rate": 5e-4, "max_length": 1024, "max_grad_norm": 1.0, "seed": 42}
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05}
bool_arg = lambda s: s.lower() == "true"
STEP_LINE = re.compile(r"INFO step (\d+):")  # a recipe's log line of step N, right after timing it
flags = lambda d: [x for k, v in d.items() for x in (f"--{k}", str(v))]


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


def build_model(out_dir: Path = RESULTS / "cache" / "tiny-llama-20m", seed: int = 0) -> str:
    """The bench model (built once, then reused): verl_kit's tiny Llama scaled up to ~20M parameters, its weights
    initialised from `seed` (another seed: the same architecture and tokenizer, other weights)."""
    from verl_kit.models import build_tiny_model

    if not (out_dir / "config.json").is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_model(str(out_dir), **MODEL_SHAPE, seed=seed)
    return str(out_dir)


def count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def word_pool(tokenizer) -> list[tuple[str, int]]:
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
    pool = word_pool(tokenizer)
    draw = lambda median, cap: int(min(cap, max(4, rng.lognormvariate(math.log(median), sigma))))
    rows = []
    for _ in range(n):
        p = draw(prompt_median, 200)
        room = max_tokens - p
        rows.append({"prompt": [{"role": "user", "content": _text(rng, pool, p)}],
                     "chosen": [{"role": "assistant", "content": _text(rng, pool, draw(completion_median, room))}],
                     "rejected": [{"role": "assistant", "content": _text(rng, pool, draw(completion_median, room))}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
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


PLAN_ROW = re.compile(r"^(?:\[\S+\] )?\s+(model state|frozen models|activations|LM-head tiles|rollout engine|"
                      r"KV cache|rollout client|this process|total)\s+([\d.]+) GiB\s*(.*)$")


def plan_terms(log: str) -> dict:
    """The memory plan's table in a recipe's log (verl_kit/train/memory_plan.py prints it at start): {term: (GiB,
    note)}, the first table's (the main process's)."""
    terms: dict = {}
    for line in log.splitlines():
        if (m := PLAN_ROW.match(line)) and m.group(1) not in terms:
            terms[m.group(1)] = (float(m.group(2)), m.group(3))
    return terms


def run_peak(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None, prefix: str = "",
             on_line=None, min_available_bytes: int = 2 * 2**30) -> dict:
    """As `run`, and the command's peak resident memory: {"wall_s", "peak_rss_bytes"}, the latter wait4's
    ru_maxrss (the largest resident set the process reached, or any descendant of it that it waited for), read when
    the process is reaped, so nothing after its last output line is missed. On a shared machine the child's process
    group is killed (RuntimeError) as soon as the machine's MemAvailable falls below `min_available_bytes` (polled
    every 50 ms), before the kernel's OOM killer would pick some process, perhaps another job's."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0, low = time.time(), []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env or bench_env(), start_new_session=True)
        done = threading.Event()

        def guard() -> None:
            while not done.wait(0.05):
                if available_bytes() < min_available_bytes or time.time() - t0 > timeout_s:
                    low.append(available_bytes())
                    os.killpg(proc.pid, 9)
                    return

        threading.Thread(target=guard, daemon=True).start()
        try:
            for line in proc.stdout:
                log.write(line)
                if on_line is not None:
                    on_line(line, proc.pid)
                print(prefix + line, end="", flush=True)
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        why = (f"killed: the machine's available memory fell to {low[0] / 2**30:.1f} GiB" if low and
               low[0] < min_available_bytes else "timed out" if low else f"exit code {proc.returncode}")
        raise RuntimeError(f"{why} after {time.time() - t0:.0f}s: {' '.join(cmd)} (log: {log_path})")
    return {"wall_s": time.time() - t0, "peak_rss_bytes": usage.ru_maxrss * 1024}


def available_bytes() -> int:
    """The machine's MemAvailable (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measured(runs: list[dict], warmup: int) -> dict:
    """Medians over the measured steps of all runs of one configuration (each run: step_time_s, step_cpu_s and
    tokens per step): non-pad tokens per wall second and per CPU second (single-threaded processes, so the latter
    is the rate on an idle core), and CPU seconds per step."""
    steps = [s for r in runs for s in list(zip(r["step_time_s"], r["step_cpu_s"], r["tokens"]))[warmup:]]
    wall, cpu = [n / t for t, _, n in steps], [n / c for _, c, n in steps]
    return {"tokens_per_cpu_s": median(cpu), "tokens_per_s": median(wall), "step_time_s": median([s[0] for s in steps]),
            "cpu_s_per_step": median([s[1] for s in steps]), "measured_steps": len(steps), "tokens_per_cpu_s_all": cpu,
            "tokens_per_s_all": wall}


def loopback_netns(cmd: list[str]) -> list[str]:
    """Wrap a multi-process command in a fresh network namespace with only loopback up (root only), so the
    rendezvous and gloo can never touch a real network; unchanged when namespaces are unavailable."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return cmd
    quoted = " ".join(shlex.quote(c) for c in cmd)
    return ["unshare", "-n", "bash", "-c", f"ip link set lo up && GLOO_SOCKET_IFNAME=lo exec {quoted}"]


def save_results(name: str, results: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (path := RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    return path


def summary_line(name: str, ratio: float, detail: str = "") -> str:
    """The one line per comparison that bench/run.py collects: `<name> ratio=<x>` (then free text)."""
    return f"{name} ratio={ratio:.3f}" + (f"  {detail}" if detail else "")


# ---- offline comparisons (dpo, kto, rm, sft, lora): alternating rounds of recipe runs and TRL runs ------------------

def offline_parser(doc: str, steps: int, batch_size: int, batch_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (odd rounds run in reverse order)")
    p.add_argument("--batch_size", type=int, default=batch_size, help=batch_help)
    p.add_argument("--packing_length", type=int, default=512, help="ours' packed row length (recipe default 512)")
    p.add_argument("--gradient_checkpointing", type=bool_arg, default=False)
    p.add_argument("--run_timeout_s", type=float, default=300)
    return p


def prepare(name: str, args, to_rows=None, per_row: int = 1) -> SimpleNamespace:
    """Build the model and write (warmup + steps) x batch_size rows of our data (the synthetic preference rows,
    each through `to_rows` into `per_row` rows if given: one epoch, every row used once) and the peer's copy of them
    in the order the recipe reads them (verl_kit.train.step_indices, one process): a peer reading it sequentially
    sees the same batches in the same order."""
    from transformers import AutoTokenizer

    from verl_kit.train import step_indices

    out = RESULTS / name
    model_dir, t0 = build_model(), time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    n, steps = (args.warmup + args.steps) * args.batch_size, args.warmup + args.steps
    paired = out / "data" / "paired.jsonl"
    stats = write_preference_data(paired, tok, -(-n // per_row))
    rows = [json.loads(line) for line in paired.read_text().splitlines()]
    lines = [json.dumps(r) for row in rows for r in (to_rows(row) if to_rows else [row])][:n]
    order = [step_indices(n, s, args.batch_size, HYPER["seed"], 0, 1) for s in range(steps)]
    (data := out / "data" / "ours.jsonl").write_text("\n".join(lines) + "\n")
    (peer_data := out / "data" / "trl.jsonl").write_text("\n".join(lines[i] for idx in order for i in idx) + "\n")
    n_params = count_parameters(model_dir)
    print(f"model: {n_params / 1e6:.1f}M parameters; data: {stats}", flush=True)
    return SimpleNamespace(name=name, out=out, model_dir=model_dir, n_params=n_params, tok=tok, data=data,
                           peer_data=peer_data, order=order, data_stats=stats, t0=t0)


def layouts(s, packing_length: int, examples, sequences) -> dict[str, list[dict]]:
    """Real, learned and laid-out token counts of every step of ours, padded and packed, through the recipe's own data
    path (`examples`: a verl_kit.data *_examples loader; `sequences(example)`: its make_batch item), so the padding
    fraction is exactly what the recipe runs."""
    from verl_kit.data import load_split
    from verl_kit.models import load_tokenizer
    from verl_kit.train import make_batch

    tok = load_tokenizer(s.model_dir)
    exs = examples(load_split(str(s.data), "train"), tok, 256, HYPER["max_length"], str(s.data))
    out = {}
    for packing in (False, True):
        cfg = SimpleNamespace(packing=packing, packing_length=packing_length)
        batches = [make_batch([sequences(exs[i]) for i in idx], cfg, tok.pad_token_id, True) for idx in s.order]
        out["packed" if packing else "padded"] = [{"tokens": b.num_tokens, "slots": b.input_ids.numel(),
                                                   "learned": int(b.scored.sum()), "shape": list(b.input_ids.shape)}
                                                  for b in batches]
    return out


def preference_sequences(e):
    """A preference example as make_batch takes it: prompt + chosen and prompt + rejected."""
    from verl_kit.train import completion_sequences

    return completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids])


def run_recipe(s, args, recipe: str, tag: str, packing: bool, hyper: dict, extra: list[str] = (),
               config: str | None = None) -> dict:
    """Run recipes/<recipe> on our data, logging every step; per step: timing_s/step and tokens from its metrics.jsonl
    and step_cpu_s: the recipe logs every step right after timing it, so the child's CPU clock read when its
    `INFO step N:` line arrives closes step N (step 1's baseline is its step-0 line, if any; NaN where a line was not
    seen), plus the run's wall time and the load average before and after. With `config` (a file of
    accelerate_configs/): two processes under `accelerate launch` in a loopback-only namespace, each with half the
    batch (the same global batch); step_cpu_s is then NaN (the clock read would be the launcher's)."""
    out_dir = s.out / "runs" / tag
    cmd = [PYTHON, f"recipes/{recipe}", "--model_name_or_path", s.model_dir, "--dataset_name", str(s.data),
           "--dataset_test_split", "none", "--output_dir", str(out_dir), "--overwrite_output_dir",
           "--max_steps", str(args.warmup + args.steps),
           "--logging_steps", "1", "--per_device_train_batch_size", str(args.batch_size // (2 if config else 1)),
           "--packing", str(packing).lower(), "--packing_length", str(args.packing_length),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower(), "--max_prompt_length", "256",
           *flags(hyper), *extra]
    if config:
        cmd = loopback_netns([PYTHON, "-m", "accelerate.commands.launch", "--config_file",
                              f"accelerate_configs/{config}", "--num_processes", "2", "--main_process_port", "29733",
                              *cmd[1:]])
    if os.path.exists(out_dir / "metrics.jsonl"):
        os.remove(out_dir / "metrics.jsonl")
    marks, load0 = {}, os.getloadavg()[0]

    def mark(line: str, pid: int) -> None:
        if (m := STEP_LINE.search(line)) and not config:
            marks[int(m.group(1))] = process_cpu_s(pid)

    wall = run(cmd, s.out / "logs" / f"{tag}.log", args.run_timeout_s, prefix=f"[{tag}] ", on_line=mark)
    with open(out_dir / "metrics.jsonl") as f:
        rows = sorted((r for r in map(json.loads, f) if "timing_s/step" in r), key=lambda r: r["step"])
    cpu = [marks.get(r["step"], math.nan) - marks.get(r["step"] - 1, math.nan) for r in rows]
    if rows and all(c != c for c in cpu[1:]) and not config:
        print(f"WARNING: {tag}: no per-step CPU times (no 'INFO step N:' lines in the recipe's output)", flush=True)
    return {"step_time_s": [r["timing_s/step"] for r in rows], "tokens": [int(r["tokens"]) for r in rows],
            "step_cpu_s": cpu, "wall_s": wall, "loadavg_before": load0, "loadavg_after": os.getloadavg()[0]}


def run_peer(s, args, script: str, tag: str, extra: list[str] = (), data: Path | None = None,
             batch_size: int | None = None) -> dict:
    """Run `bench/<script> trl-worker` (a TRL trainer through trl_train) on the peer's copy of the data; its per-step
    figures plus wall time and load averages."""
    (out_json := s.out / "runs" / f"{tag}.json").parent.mkdir(parents=True, exist_ok=True)
    cmd = [PYTHON, str(BENCH / script), "trl-worker", "--model", s.model_dir, "--data", str(data or s.peer_data),
           "--out", str(out_json), "--steps", str(args.warmup + args.steps), "--batch_size",
           str(batch_size or args.batch_size), "--gradient_checkpointing", str(args.gradient_checkpointing).lower(),
           *extra]
    load0 = os.getloadavg()[0]
    wall = run(cmd, s.out / "logs" / f"{tag}.log", args.run_timeout_s, prefix=f"[{tag}] ")
    return {**json.loads(out_json.read_text()), "wall_s": wall, "loadavg_before": load0,
            "loadavg_after": os.getloadavg()[0]}


def alternate(configs: dict, rounds: int) -> dict[str, list[dict]]:
    """Run every configuration (name -> fn(tag) -> run figures) once per round, in the given order in even rounds and
    in reverse in odd ones, so a machine that slows down or speeds up weighs on every side alike."""
    runs = {c: [] for c in configs}
    for r in range(rounds):
        for c in list(configs)[:: 1 if r % 2 == 0 else -1]:
            runs[c].append(configs[c](f"{c}_{r}"))
    return runs


def ours_vs_peer(s, args, recipe: str, hyper: dict, script: str, lay: dict | None = None) -> dict[str, list[dict]]:
    """Alternating rounds of ours padded, the TRL worker of bench/<script> (padded), ours packed. With our `layouts`,
    the tokens per step of every run are checked against them (the sides saw the same batches)."""
    ours = lambda packing: lambda tag: run_recipe(s, args, recipe, tag, packing, hyper)
    runs = alternate({"ours_padded": ours(False), "trl_padded": lambda tag: run_peer(s, args, script, tag),
                      "ours_packed": ours(True)}, args.rounds)
    if lay:
        tokens = {k: {"tokens": [x["tokens"] for x in lay[k]]} for k in ("padded", "packed")}
        check_same(runs, {"ours_padded": tokens["padded"], "trl_padded": tokens["padded"],
                          "ours_packed": tokens["packed"]})
    return runs


def check_same(runs: dict, expected: dict[str, dict[str, list]]) -> None:
    """Warn when a configuration's per-step counts (name -> key -> list) are not what it should have seen."""
    for c, keys in expected.items():
        for res in runs[c]:
            for k, want in keys.items():
                if res[k] != want:
                    print(f"WARNING: {c} {k} per step {res[k]} != {want}: the sides did not see the same batches",
                          flush=True)


def report(s, args, title: str, unit: str, runs: dict, lay: dict, pairs: list[tuple], argv=None,
           extra: dict | None = None, notes: list[str] = (), more: list[str] = ()) -> dict:
    """Figures of every configuration (measured(); padding fraction over the measured steps where its layout is known:
    ours from `lay` (name -> steps), a peer that records slots from its first run), the ratios of `pairs`
    ((summary name, ours, peer, note): tokens per CPU-second, wall in brackets), saved with `extra` as
    bench/results/<name>[_<non-default args>].json; prints the table, `notes`, then the summary lines and `more`."""
    w = args.warmup
    figs = {}
    for c, rs in runs.items():
        steps = lay.get(c) or ([{"tokens": t, "slots": n} for t, n in zip(rs[0]["tokens"], rs[0]["slots"])]
                                   if "slots" in rs[0] else None)
        figs[c] = measured(rs, w)
        if steps:
            figs[c]["padding_fraction"] = 1 - sum(x["tokens"] for x in steps[w:]) / sum(x["slots"] for x in steps[w:])
    results = {"config": {**vars(args), **HYPER, "parameters": s.n_params, "model": s.model_dir,
                          "data": s.data_stats}, **figs, "runs": runs, "layouts": lay, **(extra or {})}
    for name, ours, peer, _ in pairs:
        results[name] = figs[ours]["tokens_per_cpu_s"] / figs[peer]["tokens_per_cpu_s"]
        results[f"{name}_wall"] = figs[ours]["tokens_per_s"] / figs[peer]["tokens_per_s"]
    results["bench_wall_s"] = time.time() - s.t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    results["bench_children_cpu_s"] = ru.ru_utime + ru.ru_stime
    tag = "_".join(a.lstrip("-") for a in (sys.argv[1:] if argv is None else argv))  # non-default runs kept apart
    path = save_results(s.name + (f"_{tag}" if tag else ""), results)

    print(f"\n== {title} {s.n_params / 1e6:.1f}M params, batch {args.batch_size} {unit}, {args.rounds} rounds x "
          f"{args.steps} measured steps (+{w} warm-up), median sequence {s.data_stats['median_tokens']} tokens ==")
    for c, f in figs.items():
        pad = f"  padding {100 * f['padding_fraction']:.1f}%" if "padding_fraction" in f else ""
        print(f"{c:16s} {f['tokens_per_cpu_s']:7.1f} non-pad tokens/CPU-s  {f['tokens_per_s']:7.1f} tokens/wall-s  "
              f"{f['cpu_s_per_step']:.2f} CPU-s/step{pad}  ({f['measured_steps']} steps)")
    for line in notes:
        print(line)
    load = [r[k] for rs in runs.values() for r in rs for k in ("loadavg_before", "loadavg_after")]
    print(f"results: {path.relative_to(ROOT)}  (wall {results['bench_wall_s']:.0f}s, CPU of all child processes "
          f"{results['bench_children_cpu_s']:.0f}s); load average {min(load):.1f}..{max(load):.1f} on "
          f"{os.cpu_count()} cores (ratios per CPU-second; wall-clock ratios, noisier under load, in brackets)")
    for name, _, _, note in pairs:
        print(summary_line(name, results[name], f"(wall {results[name + '_wall']:.3f})  {note}"))
    for line in more:
        print(line)
    return results


# ---- the TRL side of the comparisons ----------------------------------------------------------------------------

def trl_args(argv: list[str], *extra: str) -> argparse.Namespace:
    """A TRL worker's flags: those run_peer and run_online_peer pass, plus `extra` optional string flags."""
    p = argparse.ArgumentParser()
    for name in ("--model", "--data", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch_size", type=int)
    p.add_argument("--gradient_checkpointing", type=bool_arg, default=False)
    for name in extra:
        p.add_argument(name)
    return p.parse_args(argv)


def mask_counts(inputs) -> dict:
    """Real (attention-mask) and laid-out tokens of a padded batch."""
    return {"tokens": int(inputs["attention_mask"].sum()), "slots": inputs["attention_mask"].numel()}


def trl_train(a, trainer_cls, config_cls, count, config: dict, model=None, **trainer_kwargs) -> None:
    """Train `trainer_cls` on a.data for a.steps steps, configured like the recipes (AdamW, linear schedule without
    warm-up, clipping, fp32 on CPU, sequential sampling, no eval, logging or checkpoints; `config` adds or overrides),
    timed by step_clock; `count(inputs)` gives a dict of figures per batch (tokens, slots, ...), nothing else changes.
    Writes the step times and the per-step list of each count to a.out. `model`: default the causal LM (fp32, sdpa)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    counts, clock = [], step_clock()

    class Counting(trainer_cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            counts.append(count(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    cfg = dict(output_dir=os.path.join(os.path.dirname(a.out), "trl_out"), per_device_train_batch_size=a.batch_size,
               gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=HYPER["learning_rate"],
               lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=HYPER["max_grad_norm"],
               optim="adamw_torch", max_length=HYPER["max_length"], gradient_checkpointing=a.gradient_checkpointing,
               gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, use_cpu=True, seed=HYPER["seed"],
               train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=10_000,
               save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    trainer = Counting(model=model, args=config_cls(**{**cfg, **config}), processing_class=AutoTokenizer.
                       from_pretrained(a.model), callbacks=[clock], **trainer_kwargs,
                       train_dataset=datasets.load_dataset("json", data_files={"train": a.data}, split="train"))
    trainer.train()
    clock.save(a.out, **{k: [c[k] for c in counts] for k in (counts[0] if counts else {})})


def step_clock():
    """A TrainerCallback reading the wall and process-CPU clocks at train begin and every step end (a step's time
    includes its data fetch and collation); save(path, **per_step) writes each step's step_time_s and step_cpu_s,
    the step_end_times (wall) and `per_step` as json."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        begin, ends = [], []

        def on_train_begin(self, *_, **__):
            self.begin[:] = [(time.perf_counter(), time.process_time())]

        def on_step_end(self, *_, **__):
            self.ends.append((time.perf_counter(), time.process_time()))

        def save(self, path, **per_step) -> None:
            marks = self.begin + self.ends
            times, cpu = ([b[i] - e[i] for e, b in zip(marks, marks[1:])] for i in (0, 1))
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({"step_time_s": times, "step_cpu_s": cpu, **per_step,
                                              "step_end_times": [e[0] for e in self.ends]}))
            print(f"trl: {len(times)} steps, step times {[round(t, 2) for t in times]}")

    return Clock()


# ---- online comparisons (ppo, grpo, distill): step time of ours against a TRL trainer on two prompt workloads -----

LENGTH = 32  # generated tokens per response, EOS ignored on both sides


def prompt_sets(model_dir: str) -> dict[str, str]:
    """`mixed`: 2000 prompts of lognormal lengths (the preference data's prompts); `uniform`: the embedded task's."""
    from transformers import AutoTokenizer

    from verl_kit.models import TINY_PREFS

    mixed = RESULTS / "cache" / "mixed_prompts.jsonl"
    if not mixed.is_file():
        write_preference_data(mixed, AutoTokenizer.from_pretrained(model_dir), n=2000, seed=0, prompt_median=40)
    return {"mixed": str(mixed), "uniform": TINY_PREFS}


def step_times(ends: list[float], warmup: int) -> list[float]:
    """Step k's time is end(k) - end(k-1), k >= 1; the first `warmup` steps are dropped."""
    return [b - a for a, b in zip(ends, ends[1:])][max(warmup - 1, 0):]


def run_online(args, out: Path, tag: str, recipe: str, extra: list[str], length: int | None = None) -> dict:
    """recipes/<recipe> (ppo.py, grpo.py or distill.py) for warmup + steps steps of one PPO epoch / iteration of one
    minibatch of one micro-batch (64 sequences), responses of exactly LENGTH tokens (`length`: responses of at most
    that many tokens, EOS kept, e.g. multi-turn episodes): step times (metrics.jsonl elapsed_s), its timing split and
    the measured steps' metrics."""
    one_update = ["--num_ppo_epochs", "1"] if recipe == "ppo.py" else ["--num_iterations", "1"]
    cmd = [PYTHON, str(ROOT / "recipes" / recipe), "--model_name_or_path", args.model, "--output_dir", str(out / tag),
           "--overwrite_output_dir",
           "--max_steps", str(args.warmup + args.steps), "--max_completion_length", str(length or LENGTH),
           "--ignore_eos", str(length is None).lower(), *one_update, "--num_mini_batches", "1",
           "--per_device_train_batch_size", "64",
           "--gradient_checkpointing", "false",
           "--learning_rate", "1e-5", "--logging_steps", "1", "--lr_scheduler_type", "constant",
           "--dataset_test_split", "none", *extra]
    run(cmd, out / f"{tag}.log", args.timeout, prefix=f"[{tag}] ")
    rows = [json.loads(line) for line in (out / tag / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert length or all(r["response_length/mean"] == LENGTH for r in rows), "EOS was not ignored"
    m = rows[args.warmup:]
    return {"step_s": step_times([r["elapsed_s"] for r in rows], args.warmup),
            "gen_s": [r["timing_s/gen"] for r in m], "inner_step_s": [r["timing_s/step"] for r in m],
            "timing": {k: median([r[k] for r in m]) for k in m[0] if k.startswith("timing_s/")}, "metrics": m}


def run_online_peer(args, out: Path, tag: str, script: str, worker: str, extra: list[str],
                    env: dict | None = None) -> dict:
    """`bench/<script> <worker>` (a TRL trainer timed by step_clock, saved to <out>/<tag>/steps.json): step times,
    and whatever else per step the worker saved there."""
    cmd = [PYTHON, str(BENCH / script), worker, "--model", args.model, "--out", str(out / tag),
           "--steps", str(args.warmup + args.steps), *extra]
    run(cmd, out / f"{tag}.log", args.timeout, env=env, prefix=f"[{tag}] ")
    saved = json.loads((out / tag / "steps.json").read_text())
    return {**{k: v for k, v in saved.items() if k not in ("step_time_s", "step_cpu_s", "step_end_times")},
            "step_s": step_times(saved["step_end_times"], args.warmup)}


def compare_workloads(args, data: dict, results: dict, lines: list, key: str, peer: str, ours_fn, peer_fn) -> None:
    """For each workload of `data` (name -> prompts path; prompt_sets: mixed, then uniform) not in args.skip (the
    order of ours and the peer alternates): run both (fn(tag, prompts path)), store the figures in results[workload]
    and append the summary line (`key` for the first workload of `data`, `key`_<workload> for the others);
    ratio = peer step time / ours."""
    for n, workload in enumerate(w for w in data if w not in args.skip):
        jobs = [("ours", ours_fn), ("trl", peer_fn)]
        got = {name: fn(f"{key}-{workload}-{name}", data[workload])
               for name, fn in (jobs if n % 2 == 0 else jobs[::-1])}
        ours, trl = median(got["ours"]["step_s"]), median(got["trl"]["step_s"])
        gen = median([g / s for g, s in zip(got["ours"]["gen_s"], got["ours"]["inner_step_s"])])
        results[workload] = {**got, "ours_step_s": ours, "trl_step_s": trl, "ours_generation_share": gen,
                             "ratio": trl / ours}
        print(f"{workload}: ours {ours:.2f}s/step (generation {100 * gen:.0f}%; "
              + ", ".join(f"{k[9:]} {v:.2f}" for k, v in got["ours"]["timing"].items()) + f"), {peer} "
              f"{trl:.2f}s/step", flush=True)
        lines.append(summary_line(key if workload == next(iter(data)) else f"{key}_{workload}", trl / ours,
                                  f"{workload} prompts: ours {ours:.2f}s/step vs {peer} {trl:.2f}s/step, "
                                  f"ours gen share {gen:.2f}"))


# ---- model state per rank: ZeRO-3 against DDP (dpo_vs_trl.py), LoRA against full (lora_vs_full.py) ----------------

ROLES = ("param_bytes", "frozen_param_bytes", "master_bytes", "grad_bytes", "optimizer_bytes")


def state_bytes(out: Path, model_dir: str, runs: dict[str, tuple[str, list[str]]], timeout_s: float) -> dict:
    """Per-rank model-state bytes (state_worker) of one 2-process run per name -> (accelerate config, worker flags)."""
    res = {}
    for name, (config, extra) in runs.items():
        (out_json := out / "runs" / f"state_{name}.json").parent.mkdir(parents=True, exist_ok=True)
        # No `--cpu`: with it accelerate's simple launcher starts ONE process. Without CUDA, torchrun's two processes
        # come up as MULTI_CPU over gloo (DDP) or DeepSpeed over gloo.
        cmd = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
               "--num_processes", "2", "--main_process_port", "29731", str(BENCH / "harness.py"), "state-worker",
               "--model", model_dir, "--out", str(out_json), *extra]
        run(loopback_netns(cmd), out / "logs" / f"state_{name}.log", timeout_s, prefix=f"[state {name}] ")
        res[name] = json.loads(out_json.read_text())
    return res


def state_worker(argv: list[str]) -> None:
    """Model state of this rank where it peaks: after the backward of the last micro-batch of a step, before the
    update, with parameters, gradients and optimizer state all live. The optimizer state exists only after a first
    step, so: one AdamW step, then the backward of one more micro-batch (gradient-accumulation boundary: under ZeRO-3
    the gradients are reduced into their partitions), then the count, before the second update (after a step DDP's
    gradients are gone, zero_grad sets them to None, while ZeRO-3's flat gradient-partition buffer persists).

    Counted: the bytes of every distinct storage, by role, a storage once under its first role: `param_bytes` the
    trained parameters' own copies (ZeRO-3: the local partitions, plus the small persistent parameters whole),
    `frozen_param_bytes` likewise for frozen ones (LoRA's base), `master_bytes` DeepSpeed's fp32 master partitions
    when they are a separate copy (on CPU they are: stage3.py `_create_fp32_partitions` compares the partition's
    torch.device("cpu") with the string "cpu"), `grad_bytes` (ZeRO-3: the flat gradient-partition buffer) and
    `optimizer_bytes` (AdamW moments). Working buffers are not counted: DDP's buckets, DeepSpeed's reduce bucket,
    parameters gathered for compute (reported apart as `gathered_param_bytes`, 0 between passes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (harness.LORA) instead of all weights")
    p.add_argument("--persistence_threshold", type=int, help="ZeRO-3 stage3_param_persistence_threshold "
                   "(DeepSpeed's default: 1e5 elements; 0: every parameter partitioned)")
    a = p.parse_args(argv)

    import torch

    from verl_kit.config import TrainConfig
    from verl_kit.models import load_causal_lm, with_lora
    from verl_kit.train import DeepSpeed, Trainable, destroy, make_accelerator

    cfg = TrainConfig(model_name_or_path=a.model, output_dir=os.path.join(os.path.dirname(a.out), "state_out"),
                      per_device_train_batch_size=2, use_peft=a.lora, **(LORA if a.lora else {}))
    accelerator = make_accelerator(cfg)
    stage = accelerator.sharding.stage if isinstance(accelerator.sharding, DeepSpeed) else 0
    zero3 = stage == 3
    if zero3 and a.persistence_threshold is not None:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        zero["stage3_param_persistence_threshold"] = a.persistence_threshold
    policy = Trainable(accelerator, with_lora(load_causal_lm(a.model, "sdpa"), cfg), cfg, 1e-4, 2)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for update in (True, False):
        ids = torch.randint(0, policy.unwrapped().config.vocab_size, (2, 128), generator=g).to(accelerator.device)
        for _ in policy.accumulate([ids]):
            policy.backward(policy.model(input_ids=ids, labels=ids).loss)
        if update:
            policy.step()

    params = list(policy.model.parameters())
    trained, frozen = [q for q in params if q.requires_grad], [q for q in params if not q.requires_grad]
    adam = lambda opt: [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    if zero3:
        ds = policy.model.optimizer
        local = lambda qs: [q.ds_tensor for q in qs] + [q.data for q in qs if q.ds_persist]
        roles = [local(trained), local(frozen), list(ds.fp32_partitioned_groups_flat),
                 [ds.grad_partitions_flat_buffer] + [q.grad for q in params]
                 + [f.grad for f in ds.fp32_partitioned_groups_flat], adam(ds.optimizer)]
        gathered = [q.data for q in params if not q.ds_persist]
    else:  # DDP, or FSDP2: each DTensor's local shard (what this rank holds)
        from torch.distributed.tensor import DTensor

        local = lambda ts: [t.to_local() if isinstance(t, DTensor) else t for t in ts if t is not None]
        opt = getattr(policy.optimizer, "optimizer", policy.optimizer)
        roles, gathered = [local(q.data for q in trained), local(q.data for q in frozen), [],
                           local(q.grad for q in params), local(adam(opt))], []
    numel = lambda qs: sum(getattr(q, "ds_numel", q.numel()) for q in qs)
    mine = {"rank": accelerator.process_index, "zero_stage": stage,
            "sharding": accelerator.sharding.name, "params": numel(params),
            "trainable_params": numel(trained), "persistent_params": numel(q for q in params if getattr(
                q, "ds_persist", False)), "full_param_bytes": sum(numel([q]) * q.element_size() for q in params)}
    seen = set()
    for role, tensors in [*zip(ROLES, roles), ("gathered_param_bytes", gathered)]:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if t is not None and t.numel() > 0}
        mine[role] = sum(v for k, v in storages.items() if k not in seen)
        seen |= storages.keys()
    mine["model_state_bytes"] = sum(mine[r] for r in ROLES)
    mine["trainable_state_bytes"] = mine["master_bytes"] + mine["grad_bytes"] + mine["optimizer_bytes"]
    ranks = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        Path(a.out).write_text(json.dumps({"ranks": ranks, "max_rank_model_state_bytes":
                                           max(r["model_state_bytes"] for r in ranks)}))
        print(json.dumps(ranks))
    destroy()


if __name__ == "__main__":
    if sys.argv[1:2] != ["state-worker"]:
        sys.exit("usage: harness.py state-worker --model DIR --out FILE [--lora] [--persistence_threshold N]")
    state_worker(sys.argv[2:])
