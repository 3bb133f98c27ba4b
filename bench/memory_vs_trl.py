"""Peak memory of a GRPO update: the LM head in tiles (verl_kit/train/lm_head.py) against the whole logits it
replaced ("before") and against TRL 1.16's GRPOTrainer, measured in the same run.

    python bench/memory_vs_trl.py                          # every part (~25 minutes on 2 CPU cores)
    python bench/memory_vs_trl.py --only update chunks     # some parts: update, trl, table, chunks
    python bench/memory_vs_trl.py --only table --table_shapes 16x256 4x1024

Every figure is one child process, its peak resident memory read from wait4 (ru_maxrss), fp32, one compute thread.

update  one GRPO update on SmolLM2-135M-Instruct (vocabulary 49,152): 8 prompts x 4 responses of 256 tokens (prompt
        32 random tokens), the 32 responses in one micro-batch, gradient checkpointing on (the recipe default):
        ours through the chunked head ("after") and with lm_head.chunkable patched to False ("before": the whole
        (tokens x vocabulary) logits of the scored positions, the path main took before lm_head.py). The update is
        grpo.py's with one update per rollout: one forward of log-probs and entropy, the clipped surrogate (dapo
        reduction, beta 0), backward, AdamW step, after a warm-up update on 2 x 8 tokens that allocates AdamW's state
        (every step after the first has it). Peak RSS of the process (model, gradients, AdamW state and the
        update), and the update's CPU seconds.
trl     whole steps against TRL's GRPOTrainer on the same workload (and our process's memory plan, term by term,
        read from its log, beside its measured peak): SmolLM2, the embedded task's prompts (chat
        template), 8 prompts x 4 completions of exactly 256 tokens (ours --ignore_eos, TRL min_new_tokens) from HF
        generate, the kind_words reward, 32 completions in one micro-batch and one optimizer step per step (TRL
        per_device_train_batch_size 32, num_generations 4, gradient_accumulation_steps 1, num_iterations 1), beta 0
        (TRL's default: no reference model on either side), learning rate 1e-6 constant, gradient checkpointing on
        both (TRL's default too). TRL 1.16's GRPOTrainer always runs its LM head in tiles (add_fused_lm_head with
        _ChunkedLogProbFunction, 32,768 vocabulary columns a tile; no config option turns it off; off Triton it
        scores every position, prompt and padding included). Peak RSS of each whole process over `--trl_steps`
        steps; step time in CPU seconds of the last step (generation included on both sides).
table   peak RSS of one update against vocabulary size and response length: the tiny Llama (hidden 128, 2 layers)
        widened to 49,152 (SmolLM2's) and to 151,936 (Qwen's) tokens, so only the vocabulary changes, at 16 x 256,
        4 x 1024 and 1 x 4096 response tokens (4,096 scored tokens each: the whole-logits path at 151,936 x 8,192
        tokens would not fit in this machine's 23 GB), before and after.
chunks  the update of `update` at chunk_size 8192 and 16384 vocabulary columns (CHUNK_SIZE is 4096): CPU seconds and
        peak RSS.
attention  one forward + backward of the tiny Llama (hidden 128, 2 heads of 64) on one packed row of 1k, 4k and 16k
        tokens (sequences of 256 tokens), with the kit's segment attention (models/packed_attention.py, "after") and
        with the dense (1, 1, L, L) fp32 block mask and "sdpa" that main used before it ("before"): peak RSS above
        the loaded model, and CPU seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import harness as h

GIB = 2**30
GRPO = h.ROOT / "recipes" / "grpo.py"
OUT = h.RESULTS / "memory_vs_trl"
SMOLLM2 = "smollm2-135m"
PROMPTS, GENERATIONS, LENGTH, PROMPT_LENGTH = 8, 4, 256, 32
LR = 1e-6
VOCABS = (49_152, 151_936)
TABLE_SHAPES = ("16x256", "4x1024", "1x4096")
CHUNKS = (8192, 16384)
PARTS = ("update", "chunks", "trl", "table", "attention")
ATTENTION_LENGTHS = (1024, 4096, 16384)
SEGMENT = 256
HEAD_TOKENS = 8192


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(PARTS), choices=PARTS, help="parts to run (default: all)")
    p.add_argument("--gradient_checkpointing", type=h.bool_arg, default=True, help="update and table parts")
    p.add_argument("--trl_gradient_checkpointing", type=h.bool_arg, default=True,
                   help="trl part, both sides")
    p.add_argument("--trl_steps", type=int, default=1, help="steps of each whole-step run (the last one is timed)")
    p.add_argument("--table_shapes", nargs="*", default=list(TABLE_SHAPES), help="responses x length")
    p.add_argument("--chunk_sizes", nargs="*", type=int, default=list(CHUNKS))
    p.add_argument("--timeout", type=float, default=1200, help="seconds per child process")
    args = p.parse_args(argv)
    from verl_kit.models import resolve_model_path

    model = resolve_model_path(SMOLLM2)
    path = h.RESULTS / "memory_vs_trl.json"
    results = json.loads(path.read_text()) if path.is_file() else {}  # a subset run keeps the other parts' figures
    results["args"], lines, t0 = vars(args), [], time.time()
    gc = args.gradient_checkpointing

    if "update" in args.only:
        results["update"] = {mode: update(f"smollm2-{mode}", model, mode, PROMPTS, GENERATIONS, LENGTH, gc,
                                          args.timeout) for mode in ("full", "chunked")}
        full, chunked = results["update"]["full"], results["update"]["chunked"]
        if "peak_gib" in full and "peak_gib" in chunked:
            lines.append(h.summary_line("memory_update_vs_full", chunked["peak_gib"] / full["peak_gib"],
                                        f"one GRPO update, SmolLM2, {PROMPTS}x{GENERATIONS} x {LENGTH} tokens: peak "
                                        f"RSS {chunked['peak_gib']:.2f} GiB chunked vs {full['peak_gib']:.2f} GiB "
                                        "whole logits (target after <= 6 GiB)"))
            lines.append(h.summary_line("memory_update_speed_vs_full", full["update_cpu_s"] / chunked["update_cpu_s"],
                                        f"update {chunked['update_cpu_s']:.1f} vs {full['update_cpu_s']:.1f} CPU-s "
                                        "(target >= 0.95: at most 5% slower)"))

    if "chunks" in args.only:
        sizes = [0, 4096, *args.chunk_sizes]  # 0: the whole logits
        results["chunks"] = heads = {str(c or "full"): head(model, c, args.timeout) for c in sizes}
        print("\n| SmolLM2 head, 8,192 tokens, forward + backward | CPU-s | peak RSS above the loaded model GiB |"
              "\n|---|---|---|")
        for c, r in heads.items():
            print(f"| {'whole logits' if c == 'full' else 'chunk_size ' + c} | {r.get('cpu_s', float('nan')):.1f} | "
                  f"{r.get('extra_gib', float('nan')):.2f} |")
        for c in args.chunk_sizes:
            a, b = heads["4096"], heads[str(c)]
            if "cpu_s" in a and "cpu_s" in b:
                lines.append(h.summary_line(f"memory_head_chunk{c}_speed_vs_4096", a["cpu_s"] / b["cpu_s"],
                                            f"{b['cpu_s']:.1f} vs {a['cpu_s']:.1f} CPU-s, {b['extra_gib']:.2f} vs "
                                            f"{a['extra_gib']:.2f} GiB above the model"))

    if "trl" in args.only:
        tgc = args.trl_gradient_checkpointing
        results["trl"] = steps = {"ours": ours_steps(model, tgc, args), "trl": trl_steps(model, tgc, args)}
        ours, trl = steps["ours"], steps["trl"]
        print_terms(ours)
        if "peak_gib" in ours and "plan" in ours and "total" in ours["plan"]:
            lines.append(h.summary_line("memory_plan_vs_peak", ours["plan"]["total"][0] / ours["peak_gib"],
                                        f"our GRPO process: the plan's {ours['plan']['total'][0]:.2f} GiB against "
                                        f"its measured peak {ours['peak_gib']:.2f} GiB (target within 0.8-1.2)"))
        if "peak_gib" in ours and "peak_gib" in trl:
            lines.append(h.summary_line("memory_vs_trl", ours["peak_gib"] / trl["peak_gib"],
                                        f"whole GRPO process, peak RSS {ours['peak_gib']:.2f} GiB vs TRL "
                                        f"{trl['peak_gib']:.2f} GiB (target <= 1.0)"))
            lines.append(h.summary_line("memory_step_speed_vs_trl", trl["step_cpu_s"] / ours["step_cpu_s"],
                                        f"step {ours['step_cpu_s']:.0f} vs TRL {trl['step_cpu_s']:.0f} CPU-s, "
                                        f"wall {ours['step_s']:.0f} vs {trl['step_s']:.0f} s (target >= 1.0)"))

    if "table" in args.only:
        results["table"] = table = {}
        for vocab in VOCABS:
            wide = widened_model(vocab)
            for shape in args.table_shapes:
                n, length = map(int, shape.split("x"))
                groups, size = (n // GENERATIONS, GENERATIONS) if n >= GENERATIONS else (1, n)
                table[f"{vocab}/{shape}"] = {mode: update(f"tiny{vocab}-{shape}-{mode}", wide, mode, groups, size,
                                                          length, gc, args.timeout) for mode in ("full", "chunked")}
        print_table(table)
        # the update's own memory, above the process before it (whose model and AdamW state grow with the vocabulary)
        after = [(k, r["chunked"]["peak_gib"] - r["chunked"]["rss_before_gib"]) for k, r in table.items()
                 if "peak_gib" in r["chunked"]]
        spread = {s: [g for k, g in after if k.endswith("/" + s)] for s in args.table_shapes}
        worst = max((max(g) / min(g) for g in spread.values() if len(g) == 2), default=float("nan"))
        lines.append(h.summary_line("memory_table_after_vocab_152k_vs_49k", worst,
                                    "largest ratio of the update's memory above the loaded model, chunked, at "
                                    "151,936 vs 49,152 over the shapes (whole logits, peak RSS: "
                                    + ", ".join(f"{s} {ratio_of(table, s):.2f}" for s in args.table_shapes) + ")"))

    if "attention" in args.only:
        results["attention"] = att = {f"{mode}/{n}": attention(mode, n, args.timeout)
                                      for n in ATTENTION_LENGTHS for mode in ("dense", "segments")}
        print("\n| packed row | before: dense mask GiB | after: segments GiB | before CPU-s | after CPU-s |"
              "\n|---|---|---|---|---|")
        for n in ATTENTION_LENGTHS:
            b, a = att[f"dense/{n}"], att[f"segments/{n}"]
            print(f"| {n:,} tokens | {b.get('extra_gib', float('nan')):.2f} | {a.get('extra_gib', float('nan')):.2f} | "
                  f"{b.get('cpu_s', float('nan')):.1f} | {a.get('cpu_s', float('nan')):.1f} |")
        b, a = att[f"dense/{ATTENTION_LENGTHS[-1]}"], att[f"segments/{ATTENTION_LENGTHS[-1]}"]
        if "extra_gib" in a and "extra_gib" in b:
            lines.append(h.summary_line("memory_attention_16k_vs_dense", a["extra_gib"] / b["extra_gib"],
                                        f"forward + backward of a {ATTENTION_LENGTHS[-1]:,}-token packed row, peak "
                                        f"above the model {a['extra_gib']:.2f} vs {b['extra_gib']:.2f} GiB, "
                                        f"{a['cpu_s']:.1f} vs {b['cpu_s']:.1f} CPU-s"))

    results["bench_wall_s"] = time.time() - t0
    h.save_results("memory_vs_trl", results)
    print("\n".join(lines))


def ratio_of(table: dict, shape: str) -> float:
    """Whole-logits peak at 151,936 over 49,152 for one shape."""
    got = [table.get(f"{v}/{shape}", {}).get("full", {}).get("peak_gib") for v in VOCABS]
    return got[1] / got[0] if None not in got else float("nan")


def print_table(table: dict) -> None:
    print("\n| vocabulary | responses x tokens | before (whole logits) GiB | after (chunked) GiB | one fp32 copy of "
          "the logits GiB | (before - after) / copy |\n|---|---|---|---|---|---|")
    for key, r in table.items():
        vocab, shape = key.split("/")
        n, length = map(int, shape.split("x"))
        copy = n * length * int(vocab) * 4 / GIB
        b, a = r["full"].get("peak_gib", float("nan")), r["chunked"].get("peak_gib", float("nan"))
        print(f"| {int(vocab):,} | {n} x {length} | {b:.2f} | {a:.2f} | {copy:.2f} | {(b - a) / copy:.2f} |")


def update(tag: str, model: str, mode: str, groups: int, size: int, length: int, gc: bool, timeout: float,
           chunk_size: int | None = None) -> dict:
    """One update-worker process: its figures and peak RSS (GiB), or the error when it failed (e.g. killed for
    memory)."""
    res = child(tag, "update-worker", ["--model", model, "--mode", mode, "--groups", str(groups), "--size", str(size),
                                       "--length", str(length), "--gradient_checkpointing", str(gc).lower()]
                + (["--chunk_size", str(chunk_size)] if chunk_size else []), timeout)
    if "error" not in res:
        print(f"{tag}: peak RSS {res['peak_gib']:.2f} GiB (before the update {res['rss_before_gib']:.2f}), update "
              f"{res['update_cpu_s']:.1f} CPU-s ({res['update_s']:.1f} s wall), {res['tokens']} response tokens",
              flush=True)
    return res


def head(model: str, chunk_size: int, timeout: float) -> dict:
    """One head-worker process (chunk_size 0: the whole logits): CPU seconds and peak RSS above the loaded model."""
    tag = f"head-{chunk_size or 'full'}"
    res = child(tag, "head-worker", ["--model", model, "--chunk_size", str(chunk_size)], timeout)
    if "error" not in res:
        print(f"{tag}: {res['cpu_s']:.1f} CPU-s, peak RSS {res['peak_gib']:.2f} GiB ({res['extra_gib']:.2f} above "
              "the loaded model)", flush=True)
    return res


def attention(mode: str, length: int, timeout: float) -> dict:
    """One attention-worker process: peak RSS above the loaded model (GiB) and CPU seconds."""
    tag = f"attention-{mode}-{length}"
    res = child(tag, "attention-worker", ["--mode", mode, "--length", str(length)], timeout)
    if "error" not in res:
        print(f"{tag}: {res['cpu_s']:.1f} CPU-s, {res['extra_gib']:.2f} GiB above the loaded model", flush=True)
    return res


def child(tag: str, worker: str, args: list[str], timeout: float) -> dict:
    """Run this script's `worker` with `args` and `--out`: the JSON it wrote and its peak RSS (peak_gib; extra_gib
    above its `rss_before` when it wrote one), or {"error"} when it failed (e.g. killed for memory)."""
    out = OUT / f"{tag}.json"
    cmd = [h.PYTHON, str(h.BENCH / "memory_vs_trl.py"), worker, "--out", str(out), *args]
    try:
        run = h.run_peak(cmd, OUT / "logs" / f"{tag}.log", timeout, prefix=f"[{tag}] ")
    except RuntimeError as e:
        print(f"FAILED {tag}: {e}", flush=True)
        return {"error": str(e)}
    res = {**json.loads(out.read_text()), **run, "peak_gib": run["peak_rss_bytes"] / GIB}
    if "rss_before" in res:
        res["extra_gib"] = (run["peak_rss_bytes"] - res["rss_before"]) / GIB
    return res


def attention_worker(argv: list[str]) -> None:
    """Forward + backward of the tiny Llama on one packed row of `length` tokens, sequences of SEGMENT tokens."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["dense", "segments"], required=True)
    p.add_argument("--length", type=int, required=True)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from verl_kit.data import layout
    from verl_kit.models import load_causal_lm, resolve_model_path

    path = resolve_model_path("tiny-llama")
    model = (load_causal_lm(path) if a.mode == "segments" else
             AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, model.config.vocab_size, (SEGMENT,), generator=g).tolist()
            for _ in range(a.length // SEGMENT)]
    batch = layout(seqs, [[True] * SEGMENT] * len(seqs), 0, True, a.length, block_mask=a.mode == "segments")
    inputs = batch.inputs()
    rss0, cpu0 = rss_bytes("VmRSS"), time.process_time()
    if a.mode == "dense":  # main before models/packed_attention.py: packing.block_causal_mask, (R, 1, L, L) fp32
        seq_ids, L = batch.seq_ids, batch.seq_ids.shape[1]
        allowed = ((seq_ids[:, :, None] == seq_ids[:, None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
                   | torch.eye(L, dtype=torch.bool))
        inputs["attention_mask"] = torch.zeros(len(seq_ids), 1, L, L).masked_fill_(~allowed[:, None],
                                                                                   torch.finfo(torch.float32).min)
    model(**inputs).logits.float().square().mean().backward()
    Path(a.out).write_text(json.dumps({"cpu_s": time.process_time() - cpu0, "rss_before": rss0, "mode": a.mode,
                                       "length": a.length}))


def head_worker(argv: list[str]) -> None:
    """Forward and backward of log-probs and entropy through SmolLM2's LM head (its tied embedding, 49,152 x 576) for
    HEAD_TOKENS random hidden states, in tiles of `chunk_size` columns (lm_head.chunked_logprobs) or from the whole
    logits (0: lm_head.full_logprobs): the only part of an update that the chunk size changes."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk_size", type=int, required=True)
    a = p.parse_args(argv)

    import torch

    from verl_kit.models import load_causal_lm
    from verl_kit.train import chunked_logprobs, full_logprobs

    weight = load_causal_lm(a.model).get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(HEAD_TOKENS, weight.shape[1], generator=g).requires_grad_()
    targets, adv = torch.randint(0, weight.shape[0], (HEAD_TOKENS,), generator=g), torch.randn(HEAD_TOKENS, generator=g)
    rss0, cpu0 = rss_bytes("VmRSS"), time.process_time()
    if a.chunk_size:
        logprobs, entropy = chunked_logprobs(hidden, weight, None, targets, 1.0, a.chunk_size)
    else:
        logprobs, entropy = full_logprobs(hidden @ weight.T, targets)
    ((logprobs * adv).mean() + 0.0 * entropy.mean()).backward()  # entropy as the update uses it: logged only
    cpu = time.process_time() - cpu0
    Path(a.out).write_text(json.dumps({"cpu_s": cpu, "rss_before": rss0, "tokens": HEAD_TOKENS,
                                       "chunk_size": a.chunk_size, "grad_norm": float(hidden.grad.norm())}))


def update_worker(argv: list[str]) -> None:
    """One GRPO update as grpo.py makes it with one update per rollout, on random prompts and responses."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["chunked", "full"], required=True)
    p.add_argument("--groups", type=int, required=True, help="prompts")
    p.add_argument("--size", type=int, required=True, help="responses per prompt")
    p.add_argument("--length", type=int, required=True, help="tokens per response")
    p.add_argument("--chunk_size", type=int, help="lm_head's vocabulary columns per tile (default CHUNK_SIZE)")
    p.add_argument("--gradient_checkpointing", type=h.bool_arg, default=True)
    a = p.parse_args(argv)

    import torch

    from verl_kit import algos, models, train
    from verl_kit.config import TrainConfig
    from verl_kit.train import actor_critic, lm_head

    if a.mode == "full":  # the path before lm_head.py: the whole logits of the scored positions
        lm_head.chunkable = lambda model: False
    if a.chunk_size:
        actor_critic.head_logprobs = functools.partial(lm_head.head_logprobs, chunk_size=a.chunk_size)
    n = a.groups * a.size
    cfg = TrainConfig(output_dir=a.out + ".d", per_device_train_batch_size=n,
                      gradient_checkpointing=a.gradient_checkpointing, max_length=PROMPT_LENGTH + a.length,
                      max_prompt_length=PROMPT_LENGTH,
                      packing_length=max(512, PROMPT_LENGTH + a.length), lr_scheduler_type="constant")
    accelerator = train.make_accelerator(cfg)
    actor = train.Trainable(accelerator, models.load_policy(a.model, cfg), cfg, LR, 2)
    actor.model.train()  # as grpo.py: transformers checkpoints activations in training mode only
    packer = train.ResponsePacker(cfg, models.load_tokenizer(a.model).pad_token_id, actor.unwrapped())
    vocab, g = actor.unwrapped().config.vocab_size, torch.Generator().manual_seed(0)

    def rollout(groups: int, size: int, length: int):
        prompts = [torch.randint(5, vocab, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(groups)]
        return SimpleNamespace(prompt_ids=[q for q in prompts for _ in range(size)], env_mask=None,
                               response_ids=torch.randint(5, vocab, (groups * size, length), generator=g),
                               response_mask=torch.ones(groups * size, length, dtype=torch.bool),
                               advantages=algos.group_advantages(torch.randn(groups * size, generator=g), size))

    def grpo_update(ro) -> dict:  # recipes/grpo.py step 4 with one update per rollout, beta 0, dapo
        rows, lengths = list(range(len(ro.prompt_ids))), ro.response_mask.sum(-1)
        phases = {}  # GiB: where the peak is
        for chunk in actor.accumulate([rows]):
            logprobs, entropy, ix = packer.forward(actor.model, ro, chunk, accelerator.device)
            phases.update(rss_after_forward=rss_bytes("VmRSS") / GIB, hwm_after_forward=rss_bytes("VmHWM") / GIB)
            loss = algos.clipped_surrogate(logprobs, logprobs - logprobs.detach(), ix.gather(ro.advantages),
                                           0.2).loss
            w = algos.loss_weights("token", ix.gather(lengths), float(lengths.sum()), len(rows), a.length)
            actor.backward(algos.global_mean_share(loss * w, 1.0, 1))
            phases["hwm_after_backward"] = rss_bytes("VmHWM") / GIB
        return {"grad_norm": actor.step(), "entropy": float(entropy.detach().mean()), "tokens": len(ix.targets),
                "laid_out_tokens": packer(ro, rows)[0].input_ids.numel(), **phases}

    grpo_update(rollout(1, 2, 8))  # allocates AdamW's state
    rss0, cpu0, t0 = rss_bytes("VmRSS"), time.process_time(), time.perf_counter()
    res = grpo_update(rollout(a.groups, a.size, a.length))
    res.update(update_cpu_s=time.process_time() - cpu0, update_s=time.perf_counter() - t0, vocab=vocab,
               rss_before_gib=rss0 / GIB, hwm_gib=rss_bytes("VmHWM") / GIB, mode=a.mode,
               chunk_size=a.chunk_size or lm_head.CHUNK_SIZE, shape=[a.groups, a.size, a.length])
    Path(a.out).write_text(json.dumps(res))
    train.destroy()


def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def widened_model(vocab: int) -> str:
    """The tiny Llama with its embedding and output layer resized to `vocab` rows (built once)."""
    out = h.RESULTS / "cache" / f"tiny-llama-vocab{vocab}"
    if not (out / "config.json").is_file():
        from verl_kit.models import load_causal_lm, load_tokenizer, resolve_model_path

        tiny = resolve_model_path("tiny-llama")
        model = load_causal_lm(tiny)
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.save_pretrained(out)
        load_tokenizer(tiny).save_pretrained(out)
    return str(out)


def ours_steps(model: str, gc: bool, args) -> dict:
    """recipes/grpo.py on the trl part's workload: peak RSS, and the CPU seconds of its last step: the child's CPU
    clock, sampled every 0.2 s, read at the step's end (its `INFO step N:` line) and at its start (that line's time
    less the step's timing_s/step), so the first step is timed without the start-up before it."""
    from verl_kit.models import TINY_PREFS  # the embedded task's prompts, on both sides

    tag, marks, clock = "ours", {}, []
    cmd = [h.PYTHON, str(GRPO), "--model_name_or_path", model, "--output_dir",
           str(OUT / tag), "--overwrite_output_dir", "--dataset_test_split", "none", "--max_steps",
           str(args.trl_steps), "--prompts_per_step", str(PROMPTS), "--num_generations", str(GENERATIONS),
           "--max_completion_length", str(LENGTH), "--ignore_eos", "true", "--per_device_train_batch_size",
           str(PROMPTS * GENERATIONS), "--num_iterations", "1", "--num_mini_batches", "1", "--beta", "0",
           "--dataset_name", TINY_PREFS, "--learning_rate", str(LR), "--lr_scheduler_type", "constant",
           "--gradient_checkpointing",
           str(gc).lower(), "--logging_steps", "1", "--save_interval_minutes", "0",
           "--reward_fn", "verl_kit.rewards:kind_words"]

    def sample(pid: int) -> None:
        while True:
            try:
                clock.append((time.time(), h.process_cpu_s(pid)))
            except (OSError, IndexError):
                return
            time.sleep(0.2)

    def mark(line: str, pid: int) -> None:
        if not clock:
            clock.append((time.time(), h.process_cpu_s(pid)))
            threading.Thread(target=sample, args=(pid,), daemon=True).start()
        if m := h.STEP_LINE.search(line):
            marks[int(m.group(1))] = (time.time(), h.process_cpu_s(pid))

    try:
        run = h.run_peak(cmd, OUT / "logs" / f"{tag}.log", args.timeout * args.trl_steps, prefix=f"[{tag}] ",
                         on_line=mark)
    except RuntimeError as e:
        print(f"FAILED {tag}: {e}", flush=True)
        return {"error": str(e)}
    rows = [json.loads(line) for line in (OUT / tag / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    assert all(r["response_length/mean"] == LENGTH for r in rows), "EOS was not ignored"
    end_wall, end_cpu = marks[rows[-1]["step"]]
    start = end_wall - rows[-1]["timing_s/step"]
    start_cpu = next(c for t, c in reversed(clock) if t <= start)  # the last sample before the step began
    return {**run, "peak_gib": run["peak_rss_bytes"] / GIB, "step_cpu_s": end_cpu - start_cpu,
            "step_s": rows[-1]["timing_s/step"], "timing": {k: v for k, v in rows[-1].items() if "timing" in k},
            "gradient_checkpointing": gc, "plan": h.plan_terms((OUT / "logs" / f"{tag}.log").read_text()),
            "peak_rss_gib_logged": max(r["perf/peak_rss_gib"] for r in rows)}


def print_terms(ours: dict) -> None:
    """The plan's terms of our whole GRPO process beside its measured peak: where the peak goes."""
    print("\n| our GRPO process, term of the plan (train/memory_plan.py) | GiB | what it is |\n|---|---|---|")
    for term, (gib, note) in ours.get("plan", {}).items():
        print(f"| {term} | {gib:.2f} | {note[:90]} |")
    print(f"| measured peak RSS (wait4; perf/peak_rss_gib {ours.get('peak_rss_gib_logged', float('nan')):.2f}) | "
          f"{ours.get('peak_gib', float('nan')):.2f} | the trainer process; HF generate runs inside it |")


def trl_steps(model: str, gc: bool, args) -> dict:
    from verl_kit.models import TINY_PREFS

    tag, out = "trl", OUT / "trl"
    cmd = [h.PYTHON, str(h.BENCH / "memory_vs_trl.py"), "trl-worker", "--model", model, "--out", str(out),
           "--data", TINY_PREFS, "--steps", str(args.trl_steps), "--gradient_checkpointing", str(gc).lower()]
    try:
        run = h.run_peak(cmd, OUT / "logs" / f"{tag}.log", args.timeout * args.trl_steps, prefix=f"[{tag}] ")
    except RuntimeError as e:
        print(f"FAILED {tag}: {e}", flush=True)
        return {"error": str(e)}
    saved = json.loads((out / "steps.json").read_text())
    return {**saved, **run, "peak_gib": run["peak_rss_bytes"] / GIB, "step_cpu_s": saved["step_cpu_s"][-1],
            "step_s": saved["step_time_s"][-1]}


def trl_worker(argv: list[str]) -> None:
    a = h.trl_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_kit.data import load_split
    from verl_kit.rewards import kind_words

    def kind(prompts, completions, **_):  # conversational completions arrive as [{"role", "content"}]
        return kind_words(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions])

    lengths = []

    class Counting(GRPOTrainer):  # checks that every completion has LENGTH tokens
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            lengths.extend(out["completion_mask"].sum(-1).tolist())
            return out

    config = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=LENGTH, generation_kwargs={"min_new_tokens": LENGTH},
        gradient_accumulation_steps=1, num_iterations=1, beta=0.0, learning_rate=LR, lr_scheduler_type="constant",
        temperature=1.0, top_p=1.0, use_cpu=True, bf16=False, gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=42, dataloader_num_workers=0)
    clock = h.step_clock()
    trainer = Counting(model=AutoModelForCausalLM.from_pretrained(a.model, dtype="float32"), reward_funcs=kind,
                       args=config, train_dataset=load_split(a.data, "train").select_columns(["prompt"]),
                       processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[clock])
    trainer.train()
    assert set(lengths) == {LENGTH}, f"completion lengths {sorted(set(lengths))}, expected {LENGTH}"
    clock.save(f"{a.out}/steps.json", config={k: getattr(config, k) for k in (
        "per_device_train_batch_size", "num_generations", "max_completion_length", "gradient_accumulation_steps",
        "num_iterations", "beta", "loss_type", "gradient_checkpointing", "learning_rate")})


if __name__ == "__main__":
    workers = {"update-worker": update_worker, "head-worker": head_worker, "trl-worker": trl_worker,
               "attention-worker": attention_worker}
    workers[sys.argv[1]](sys.argv[2:]) if sys.argv[1:2] and sys.argv[1] in workers else main()
