"""GRPO step time on a long-tail workload: in-flight updates (`--async_rollout --partial_rollout`) against one-step-off
(`--async_rollout`) and synchronous rollouts, in the same run.

    python bench/inflight_vs_async.py                 # bench model with a long tail, vLLM server in its own process
    python bench/inflight_vs_async.py --steps 8 --rounds 3

recipes/grpo.py on the embedded task with `--rollout vllm-server`, 16 prompts x 4 responses of at most 256 tokens per
step. The workload's long tail: the bench model with its output layer's EOS row scaled by --eos_scale (80), so that
a response ends early in most contexts and never in some: measured with HF sampling on 32 responses, median 33
tokens, mean 66, 90th percentile 253 (about one response in eight runs to the cap, eight times the median); the
learning rate is 1e-7 so that the workload stays what it is over the run (at the recipe's default the policy learns
within two steps to end later: mean length 27 -> 167). Runs
alternate sync / one-step-off / in-flight (max_staleness 1 and 2), each step's time is the recipe's timing_s/step,
the first --warmup steps of every run left out; the trainer's idle share is timing_s/gen / timing_s/step (its wait
for the batch). `inflight_vs_async ratio=<one-step-off step / in-flight step at max_staleness 2>`.
"""

from __future__ import annotations

import argparse
import json

from harness import PYTHON, RESULTS, ROOT, bench_env, build_model, median, run, save_results, summary_line

MODES = {"sync": [], "async": ["--async_rollout"],
         "inflight1": ["--async_rollout", "--partial_rollout", "--max_staleness", "1"],
         "inflight2": ["--async_rollout", "--partial_rollout", "--max_staleness", "2"]}


def long_tail_model(scale: float) -> str:
    """The bench model with the EOS row of its (untied) output layer scaled by `scale` (built once)."""
    out = RESULTS / "cache" / f"tiny-llama-20m-eos{scale:g}"
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM

        from verl_kit.models import load_tokenizer

        base = build_model()
        tokenizer = load_tokenizer(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight[tokenizer.eos_token_id] *= scale
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def grpo(mode: str, rnd: int, args, model: str) -> list[dict]:
    out = RESULTS / "inflight_vs_async" / f"{mode}_{rnd}"
    cmd = [PYTHON, str(ROOT / "recipes" / "grpo.py"), "--model_name_or_path", model, "--rollout", "vllm-server",
           "--max_steps", str(args.steps), "--prompts_per_step", "16", "--num_generations", "4",
           "--max_completion_length", "256", "--max_prompt_length", "64", "--max_length", "320", "--logging_steps", "1",
           "--eval_steps", "1000000", "--dataset_test_split", "none", "--output_dir", str(out),
           "--overwrite_output_dir", "--learning_rate", "1e-7", *MODES[mode]]
    env = bench_env()
    env["VLLM_HOST_IP"] = "127.0.0.1"
    run(cmd, out.with_suffix(".log"), 3600, env=env, prefix=f"[{mode} {rnd}] ")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return [r for r in rows if "timing_s/step" in r][args.warmup:]


def summarize(steps: list[dict]) -> dict:
    step = median([r["timing_s/step"] for r in steps])
    return {"step_s": step, "idle_share": median([r["timing_s/gen"] / r["timing_s/step"] for r in steps]),
            "response_length_mean": median([r.get("response_length/mean", r.get("rollout/response_length", 0))
                                            for r in steps]),
            "version_lag_max": max((r.get("rollout/version_lag_max", 0) for r in steps), default=0),
            "groups_dropped_stale": sum(r.get("rollout/groups_dropped_stale", 0) for r in steps),
            "measured_steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eos_scale", type=float, default=80.0)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    model = long_tail_model(args.eos_scale)
    modes = args.modes.split(",")
    steps: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            steps[mode] += grpo(mode, rnd, args, model)
    results = {m: summarize(s) for m, s in steps.items()}
    results["args"] = vars(args)
    save_results("inflight_vs_async", results)
    print(json.dumps(results, indent=2))
    r = {m: results[m] for m in modes}
    ratio = r["async"]["step_s"] / r["inflight2"]["step_s"] if {"async", "inflight2"} <= set(r) else float("nan")
    print(summary_line("inflight_vs_async", ratio, ", ".join(
        f"{m} {v['step_s']:.2f} s/step (trainer idle {100 * v['idle_share']:.0f}%, dropped "
        f"{v['groups_dropped_stale']:g})" for m, v in r.items())))


if __name__ == "__main__":
    main()
