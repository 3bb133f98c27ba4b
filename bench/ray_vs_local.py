"""Overhead of `make cluster-run` (a Ray job, one node, two processes) against `accelerate launch` of the same job.

    python bench/ray_vs_local.py            # last line: ray_vs_local ratio=<ray step time / local step time>
    RAY_VS_LOCAL_ROUNDS=1 python bench/ray_vs_local.py     # one run each instead of two (ABBA order)

Both runs train the bench's ~20M-parameter model with DPO under ZeRO-3 for the same steps on the same machine. The
ratio compares the steady-state step time (median timing_s/step after the first steps); the startup overhead (wall
time minus the time spent in steps) is printed beside it, and the time to bring the Ray head up separately. Target:
step time within 5% of the local run. Runs in its own loopback-only network and PID namespaces (root), so the Ray
head can reach nothing else and every process it started dies with the benchmark.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import RESULTS, ROOT, bench_env, build_model, median, run, save_results, summary_line

STEPS = 20
WARMUP = 3  # steps left out of the steady-state median
MARK = "VERL_KIT_BENCH_NS"


def isolate() -> None:
    """Re-run this script as PID 1 of fresh network + PID namespaces with only loopback up."""
    if os.environ.get(MARK) or os.geteuid() != 0 or not shutil.which("unshare"):
        return
    if subprocess.run(["unshare", "-n", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode:
        return
    cmd = ["unshare", "-n", "-p", "-f", "--mount-proc", "bash", "-c",
           'ip link set lo up && exec "$@"', "bash", sys.executable, *sys.argv]
    sys.exit(subprocess.call(cmd, env={**os.environ, MARK: "1"}))


def main() -> int:
    isolate()
    rounds = int(os.environ.get("RAY_VS_LOCAL_ROUNDS", "2"))
    env = bench_env()
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    model = build_model()
    args = ["--model_name_or_path", model, "--max_steps", str(STEPS), "--logging_steps", "1",
            "--dataset_test_split", "none", "--per_device_train_batch_size", "4",
            "--dataset_train_split", "train[:256]"]  # fewer reference log-probs to score before step 1
    work = Path(tempfile.mkdtemp(prefix="vkb-", dir="/tmp"))
    logs = RESULTS / "ray_vs_local"
    cluster = [sys.executable, "-m", "verl_kit.launch.cluster"]
    local_cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml",
                 "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", "29561",
                 "recipes/dpo.py", *args]
    ray_cmd = cluster + ["run", "--nodes", "1", "--procs_per_node", "2", "--accelerate_config",
                         "accelerate_configs/zero3.yaml", "--", *args]
    walls, step_times, startups = ({"local": [], "ray": []} for _ in range(3))
    try:
        t = time.time()
        run(cluster + ["up", "--node_ip", "127.0.0.1", "--temp_dir", str(work / "ray")], logs / "up.log", 180,
            env, "[up] ")
        up_s = time.time() - t
        # ABBA order (local, ray, ray, local, ...): a machine that slows down or speeds up during the benchmark
        # weighs on both sides equally.
        order = [("local", "ray") if r % 2 == 0 else ("ray", "local") for r in range(rounds)]
        for r, pair in enumerate(order):
            for side in pair:
                out = work / f"{side}{r}"
                cmd = (local_cmd if side == "local" else ray_cmd) + ["--output_dir", str(out)]
                wall = run(cmd, logs / f"{side}{r}.log", 900, env, f"[{side} {r}] ")
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
                st = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
                walls[side].append(wall)
                step_times[side] += st[WARMUP:]
                startups[side].append(wall - sum(st))
    finally:
        if os.environ.get(MARK):  # `ray stop` only sees our PID namespace here
            subprocess.run(cluster + ["down", "--force"], env=env, capture_output=True, cwd=ROOT, timeout=120)
        else:  # shared host: end only the Ray processes that use our temp dir
            import psutil

            for p in psutil.process_iter(["cmdline"]):
                if str(work) in " ".join(p.info["cmdline"] or []):
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)
    res = {side: {"wall_s": walls[side], "step_s": median(step_times[side]), "startup_s": median(startups[side])}
           for side in walls}
    res["ray"]["cluster_up_s"] = up_s
    print(f"results: {save_results('ray_vs_local', {'steps': STEPS, 'rounds': rounds, **res})}")
    for side in ("local", "ray"):
        print(f"{side}: step {res[side]['step_s']:.3f}s (median of steps {WARMUP + 1}..{STEPS}), startup "
              f"{res[side]['startup_s']:.1f}s, walls {', '.join(f'{w:.0f}s' for w in walls[side])}")
    print(f"cluster up (once): {up_s:.1f}s")
    ratio = res["ray"]["step_s"] / res["local"]["step_s"]
    print(summary_line("ray_vs_local", ratio, f"step_s ray/local={res['ray']['step_s']:.3f}/"
                       f"{res['local']['step_s']:.3f} startup_s ray/local={res['ray']['startup_s']:.1f}/"
                       f"{res['local']['startup_s']:.1f} rounds={rounds} (target: ratio <= 1.05)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
