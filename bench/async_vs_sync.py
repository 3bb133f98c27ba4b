"""GRPO step time, one-step-off-policy rollouts (`--async_rollout`) against synchronous ones, in the same run.

    python bench/async_vs_sync.py                 # bench model, vLLM server in its own process
    python bench/async_vs_sync.py --steps 8 --rounds 3

recipes/grpo.py on the embedded task with the bench model and `--rollout vllm-server`, responses of exactly
--new_tokens tokens; runs alternate sync / async, each step's time is the recipe's timing_s/step, the first --warmup
steps of every run left out. `async_vs_sync ratio=<sync step / async step>`; the generation share is timing_s/gen /
timing_s/step of the synchronous runs, the ideal ratio (perfect overlap) step / max(gen, step - gen).
"""

from __future__ import annotations

import argparse
import json

from harness import PYTHON, RESULTS, ROOT, bench_env, build_model, median, run, save_results, summary_line


def grpo(mode: str, rnd: int, args, model: str) -> list[dict]:
    out = RESULTS / "async_vs_sync" / f"{mode}_{rnd}"
    cmd = [PYTHON, str(ROOT / "recipes" / "grpo.py"), "--model_name_or_path", model, "--rollout", "vllm-server",
           "--max_steps", str(args.steps), "--prompts_per_step", str(args.prompts), "--num_generations", "4",
           "--max_completion_length", str(args.new_tokens), "--ignore_eos", "true", "--logging_steps", "1",
           "--eval_steps", "1000000", "--dataset_test_split", "none", "--output_dir", str(out),
           "--overwrite_output_dir"]
    if mode == "async":
        cmd.append("--async_rollout")
    env = bench_env()
    env["VLLM_HOST_IP"] = "127.0.0.1"
    run(cmd, out.with_suffix(".log"), 1800, env=env, prefix=f"[{mode} {rnd}] ")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return [r for r in rows if "timing_s/step" in r][args.warmup:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x4 responses)")
    ap.add_argument("--new_tokens", type=int, default=128, help="response length (ignore_eos)")
    args = ap.parse_args()
    model = build_model()
    steps: dict[str, list[dict]] = {"sync": [], "async": []}
    for rnd in range(args.rounds):
        for mode in ("sync", "async"):
            steps[mode] += grpo(mode, rnd, args, model)
    sync_step = median([r["timing_s/step"] for r in steps["sync"]])
    async_step = median([r["timing_s/step"] for r in steps["async"]])
    gen = median([r["timing_s/gen"] for r in steps["sync"]])
    ideal = sync_step / max(gen, sync_step - gen)
    ratio = sync_step / async_step
    results = {"sync_step_s": sync_step, "async_step_s": async_step, "sync_gen_s": gen, "gen_share": gen / sync_step,
               "ideal_ratio": ideal, "ratio": ratio, "of_ideal": ratio / ideal,
               "async_wait_s": median([r["timing_s/gen"] for r in steps["async"]]),
               "staleness": sorted({r["rollout/staleness"] for r in steps["async"]}), "args": vars(args)}
    save_results("async_vs_sync", results)
    print(summary_line("async_vs_sync", ratio, f"sync {sync_step:.3f} s/step, async {async_step:.3f} s/step; gen share "
                       f"{gen / sync_step:.2f} of the sync step, ideal {ideal:.3f}, {100 * ratio / ideal:.0f}% of "
                       f"ideal; async still waits {results['async_wait_s']:.3f} s/step for its batch"))


if __name__ == "__main__":
    main()
