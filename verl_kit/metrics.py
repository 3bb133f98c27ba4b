"""Run logging: a readable INFO line per logging step, a progress bar, `<output_dir>/metrics.jsonl` (one JSON object
per logged step), the accelerate trackers (wandb, tensorboard) and, at the end, a PNG of the curves."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time

import torch

from verl_kit.durable import write_failure, write_text
from verl_kit.errors import UserError

logger = logging.getLogger("verl_kit")


class _TqdmHandler(logging.StreamHandler):
    """Log records printed above the progress bar (tqdm.write), so a bar and a log line never share a line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(is_main: bool) -> None:
    """INFO on the main process (WARNING elsewhere), routed through the progress bar. Library progress bars (model
    loading, shard writing, dataset maps) stay off the recipe's console unless VERL_KIT_LIBRARY_BARS=1."""
    import warnings

    # torch renamed the collectives DeepSpeed calls; the warning repeats on every step and says nothing to users.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(handlers=[handler], level=logging.INFO if is_main else logging.WARNING, force=True)
    # httpx2: the openai SDK's HTTP client (a line per request of every agent's client); httpx: vLLM's, wandb's
    for noisy in ("httpx", "httpx2", "datasets", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if os.environ.get("VERL_KIT_LIBRARY_BARS") != "1":
        import datasets
        import huggingface_hub.utils
        import transformers

        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()


def progress(iterable, desc: str, total: int, is_main: bool):
    """A progress bar over a long phase (reference scoring, evaluation) on the main process, left under the step bar
    when done; a start line in the log either way (VERL_KIT_NO_BAR=1 turns the bars off)."""
    from tqdm.auto import tqdm

    if is_main:
        logger.info(f"{desc}: {total} batches")
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True,
                disable=not is_main or os.environ.get("VERL_KIT_NO_BAR") == "1")


class Timer:
    """Seconds per phase of a step, summed when a phase runs several times: `with timer("gen"): ...`, then
    `timer.seconds` -> {"timing_s/gen": ...}."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.time()
        try:
            yield
        finally:
            key = f"timing_s/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.time() - t0

    def each(self, phase: str, iterable):
        """The items of `iterable`, the whole loop over them (its bodies included) timed as `phase`: `for update in
        timer.each("update_actor", updates): ...` is one nesting level where a `with` around the loop is two."""
        with self(phase):
            yield from iterable


def check_writable(output_dir: str) -> None:
    """A UserError naming --output_dir when it cannot be created or written."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--output_dir {output_dir}: not writable ({e.strerror})") from None


def rows_through(path: str, step: int) -> list[str]:
    """The lines of a JSON-lines log (metrics.jsonl, samples.jsonl) whose `step` is at most `step`. A line that does
    not parse (the last one, torn by a crash mid-write) is dropped with a warning naming the file and line."""
    kept, torn = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                torn.append(number)
                continue
            if row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    if torn:
        logger.warning(f"{path}: line {', '.join(map(str, torn))} is not JSON (cut short by a crash?): dropped")
    return kept


# The keyword each tracker's init takes for --run_name (accelerate passes init_kwargs[tracker] to it)
RUN_NAME_KEYS = {"wandb": "name", "trackio": "name", "mlflow": "run_name", "swanlab": "experiment_name"}


def pair_sums(losses: torch.Tensor, rewards: torch.Tensor) -> dict:
    """What a preference recipe (DPO, the reward model) tallies of a micro-batch: per-pair `losses` (B,) and the
    (chosen, rejected) rewards (B, 2) -> the sums pair_metrics reads (detached)."""
    r = rewards.detach()
    return {"loss": losses.detach(), "correct": r[:, 0] > r[:, 1], "margin": r[:, 0] - r[:, 1], "chosen": r[:, 0],
            "rejected": r[:, 1]}


def pair_metrics(sums: dict, pairs: float) -> dict:
    """A preference step's metrics from the step's summed pair_sums over its `pairs` pairs, as TRL's DPO names them:
    loss, rewards/accuracy (the share whose chosen reward is the higher), rewards/margin, rewards/chosen,
    rewards/rejected (means)."""
    return {"loss": sums["loss"] / pairs, "rewards/accuracy": sums["correct"] / pairs,
            **{f"rewards/{k}": sums[k] / pairs for k in ("margin", "chosen", "rejected")}}


def _peak_rss_kib() -> int:
    """This process's resident high-water mark in KiB: VmHWM, its memory's own (getrusage's ru_maxrss survives exec,
    so a recipe started by a large process, a test worker, would report its parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_memory() -> dict[str, float]:
    """This process's peak memory so far, in GiB: `perf/peak_rss_gib` (resident, the kernel's high-water mark: what
    an out-of-memory kill compares) and, on CUDA, `perf/peak_gpu_gib` (torch.cuda.max_memory_allocated)."""
    out = {"perf/peak_rss_gib": round(_peak_rss_kib() / 2**20, 3)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out


class MetricsLogger:
    """Main-process sink for metrics. On resume, rows past the resumed step (logged by the killed run after its last
    checkpoint) are dropped so that metrics.jsonl reads as one run; the files are rewritten atomically, and each row
    is synced to the device as it is appended (a checkpoint never outlives the metrics before it)."""

    def __init__(self, accelerator, output_dir: str, total_steps: int, start_step: int = 0, config: dict | None = None,
                 run_name: str | None = None):
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self.start = time.time()
        self.start_step, self.total_steps = start_step, total_steps
        self.bar = None
        if not self.main:
            return
        for path in (self.path, self.samples_path):
            if os.path.exists(path):
                write_text(path, "".join(rows_through(path, start_step)) if start_step > 0 else "")
        if accelerator.log_with:
            init = {t: {key: run_name} for t, key in RUN_NAME_KEYS.items()} if run_name else {}
            # a mapping flag (--chat_template_kwargs) as its JSON text: TensorBoard's hparams take scalars only
            flat = config and {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in config.items()}
            accelerator.init_trackers("verl-kit", config=flat, init_kwargs=init)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                        disable=os.environ.get("VERL_KIT_NO_BAR") == "1")

    def log(self, step: int, metrics: dict) -> None:
        """Append metrics for `step` to metrics.jsonl and the trackers, and write them as one INFO line."""
        if not self.main:
            return
        row = {"step": step, "elapsed_s": round(time.time() - self.start, 3),
               **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}, **peak_memory()}
        _append(self.path, [json.dumps(row) + "\n"])
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, float)}, step=step)
        # Per-phase timings and weight-sync details go to metrics.jsonl and the trackers, not the console line.
        text = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if not k.startswith(("timing_s/", "sync/")))
        logger.info(f"step {step}: {text} elapsed={row['elapsed_s']:.0f}s")

    def log_samples(self, samples: list[dict]) -> None:
        """Append sample rows ({step, prompt, completion, reward, reference}) to samples.jsonl, print the first as
        one INFO line, and send them as a table to wandb when it is a tracker."""
        if not self.main or not samples:
            return
        _append(self.samples_path, [json.dumps(s, default=str) + "\n" for s in samples])
        s = samples[0]
        logger.info(f"sample at step {s['step']}: reward={_fmt(s['reward'])} prompt={_short(s['prompt'])!r} "
                    f"completion={_short(s['completion'])!r} reference={_short(s.get('reference'))!r}")
        if any(str(getattr(t, "value", t)) == "wandb" for t in self.accelerator.log_with or []):
            import wandb

            columns = ["step", "prompt", "completion", "reward", "reference"]
            table = wandb.Table(columns=columns, data=[[str(s.get(c)) for c in columns] for s in samples])
            self.accelerator.get_tracker("wandb").log({"samples": table}, step=s["step"])

    def advance(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def end_step(self, step: int, metrics: dict, logging_steps: int, eval_steps: int, evaluate=None,
                 progress: str = "reward/mean") -> bool:
        """The end of optimizer step `step` (counted from 1) of an online recipe, on every process: the progress bar
        shows `metrics[progress]`; at an evaluation step (every `eval_steps`, and the last) `evaluate()`'s held-out
        metrics (collective: every process calls it) join `metrics`; at a logging step (every `logging_steps`, this
        run's first step, the last, an evaluation step) `metrics` are logged. `evaluate` None: no held-out split.
        Returns whether it logged (the recipe then logs a few samples beside: log_samples)."""
        self.advance(**{progress.split("/")[0]: metrics[progress]})
        last = step == self.total_steps
        do_eval = evaluate is not None and (step % eval_steps == 0 or last)
        if do_eval:
            metrics.update(evaluate())
        logged = step % logging_steps == 0 or step == self.start_step + 1 or last or do_eval
        if logged:
            self.log(step, metrics)
        return logged

    def close(self, plot_keys: list[str]) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.close()
        if self.accelerator.log_with:
            self.accelerator.end_training()
        plot_curves(self.path, plot_keys, os.path.join(os.path.dirname(self.path), "curves.png"))


def _append(path: str, lines: list[str]) -> None:
    """Append and sync; a write the device refuses (no space, quota, read-only) stops the run in one line (a torn
    last line is dropped on resume: MetricsLogger), any other error raises on."""
    try:
        with open(path, "a") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        reason = write_failure(e, os.path.dirname(os.path.abspath(path)))
        if reason is None:
            raise
        raise UserError(f"{path}: appending failed ({reason}); the run stops and the checkpoints on disk are intact: "
                        "free space, then continue with --resume_from_checkpoint auto") from None


def _short(x, n: int = 80) -> str:
    """Chat messages -> the last message's content; anything -> at most n characters."""
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        x = x[-1].get("content", "")
    text = x if isinstance(x, str) else json.dumps(x, default=str)
    return text if len(text) <= n else text[:n - 3] + "..."


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) and abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def plot_curves(metrics_path: str, keys: list[str], out_png: str) -> None:
    """One panel per metric key present in metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keys = [k for k in keys if any(k in r for r in rows)]
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, k in zip(axes[0], keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
