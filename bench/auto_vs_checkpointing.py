"""Issue 57's headline run two ways: GRPO on SmolLM2 (recipes/configs/grpo_arith.yaml with 256-token answers:
--max_completion_length 256 --max_length 352 --packing_length 2048 --ignore_eos true, colocated vLLM) with gradient
checkpointing off and `--max_tokens_per_microbatch auto` (the default: the memory plan splits the micro-batches where
the unsplit step would not fit --memory_fraction of the machine), against checkpointing on. On main 64ad734 the first
was killed by the kernel's OOM killer in its second step (20.7 GB resident on a 24 GiB machine).

    python bench/auto_vs_checkpointing.py            # 2 steps each, ~40 minutes on 2 CPU cores

Prints, for each: the plan's total (the trainer's, and the engine's beside it), the budget auto chose, the trainer's
measured peak (perf/peak_rss_gib, every step) and the update's seconds per step; then one summary line
`auto_vs_checkpointing ratio=<update time with checkpointing / under auto>`.
"""

from __future__ import annotations

import argparse
import json
import re

import harness as h

OUT = h.RESULTS / "auto_vs_checkpointing"
RUN = ["--config", str(h.ROOT / "recipes" / "configs" / "grpo_arith.yaml"), "--max_completion_length", "256",
       "--max_length", "352", "--packing_length", "2048", "--ignore_eos", "true", "--logging_steps", "1",
       "--eval_steps", "100", "--save_steps", "100", "--save_interval_minutes", "0", "--dataset_test_split", "none"]
CHOSEN = re.compile(r"micro-batches of at most (\d+) tokens")


def one(tag: str, extra: list[str], steps: int, timeout: float) -> dict:
    out = OUT / tag
    log = OUT / "logs" / f"{tag}.log"
    cmd = [h.PYTHON, str(h.ROOT / "recipes" / "grpo.py"), *RUN, "--max_steps", str(steps), "--output_dir", str(out),
           "--overwrite_output_dir", *extra]
    try:
        h.run(cmd, log, timeout, env=h.bench_env(), prefix=f"[{tag}] ")
    except RuntimeError as e:
        print(f"FAILED {tag}: {e}", flush=True)
        return {"error": str(e)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    text = log.read_text()
    terms = h.plan_terms(text)
    chosen = CHOSEN.search(text)
    engine = terms.get("rollout engine", (0.0, ""))[0]
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]
    return {"plan_gib": terms["total"][0] - engine, "engine_gib": engine,
            "budget": int(chosen.group(1)) if chosen else None,
            "peak_gib": max(r["perf/peak_rss_gib"] for r in rows if "perf/peak_rss_gib" in r),
            "update_s": [r.get("timing_s/update_actor") for r in steps_rows],
            "step_s": [r["timing_s/step"] for r in steps_rows]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = p.parse_args(argv)
    results = {"auto": one("auto", ["--gradient_checkpointing", "false"], args.steps, args.timeout),
               "checkpointing": one("checkpointing", ["--gradient_checkpointing", "true"], args.steps, args.timeout)}
    h.save_results("auto_vs_checkpointing", {"args": vars(args), "results": results})
    print("\n| run | plan GiB (trainer, + engine) | budget | measured peak GiB | update s/step | step s |"
          "\n|---|---|---|---|---|---|")
    for tag, r in results.items():
        if "error" in r:
            print(f"| {tag} | failed | | | | |")
            continue
        print(f"| {tag} | {r['plan_gib']:.2f} + {r['engine_gib']:.2f} | {r['budget'] or 'unsplit'} "
              f"| {r['peak_gib']:.2f} | {', '.join(f'{s:.0f}' for s in r['update_s'] if s)} "
              f"| {', '.join(f'{s:.0f}' for s in r['step_s'])} |")
    a, c = results["auto"], results["checkpointing"]
    if "error" not in a and "error" not in c:
        mean = lambda xs: sum(x for x in xs if x) / max(1, len([x for x in xs if x]))  # noqa: E731
        print(f"auto_vs_checkpointing ratio={mean(c['update_s']) / mean(a['update_s']):.2f} (update time, "
              f"checkpointing on / auto) peak_gib auto={a['peak_gib']:.2f} checkpointing={c['peak_gib']:.2f}")


if __name__ == "__main__":
    main()
