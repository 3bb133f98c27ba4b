"""SFT throughput: `recipes/sft.py` against TRL's SFTTrainer, measured in the same run.

    python bench/sft_vs_trl.py                  # the whole comparison (about 10 minutes on 2 CPU cores)
    python bench/sft_vs_trl.py --rounds 1       # quicker, noisier

Same ~20M-parameter Llama (bench/common.py), same prompt + completion rows (the synthetic preference rows of
bench/common.py with their chosen side; conversational, median ~175 tokens, long tail), completion-only loss, same
optimizer, schedule and steps. TRL runs in three modes, ours padded or packed (best-fit into rows of
`--packing_length` 512 under a 4D block-diagonal mask: exact):
- `padded`: the same 8 rows per step in the same order as ours (TRL reads, sequentially, a copy of the data written in
  the order recipes/sft.py reads it), right-padded to the longest; the per-step token counts are checked to agree;
- `padding_free` (no packing): the same rows, concatenated into ONE row with restarting position ids and no attention
  mask. As SFTTrainer passes use_cache=False, transformers 5.19 rebuilds a block-diagonal mask from the position ids
  (masking_utils.find_packed_sequence_indices), so nothing leaks across sequences under CPU sdpa (checked: same loss
  as padded, logits equal to separate forwards within 1e-6; with a KV cache they would leak). sdpa still computes
  every query-key pair of that row: attention grows with the square of the whole batch's token count;
- `bfd` (packing=True, strategy "bfd", which implies padding-free): the whole dataset is packed best-fit decreasing
  into rows of 1024 tokens (max_length, TRL's default), so steps no longer hold our rows in our order;
  `--trl_packed_rows` 2 rows per step (about the tokens of our 8 rows), concatenated into one row as above.
TRL's "wrapped" strategy cuts sequences mid-way and lets them attend across boundaries with positions that never
restart: a different training, not measured. `sft_vs_trl`: ours packed against the faster of TRL padding_free and
bfd; `sft_padded_vs_trl`: padded against padded. Runs alternate (ours, the TRL modes, ours, then the reverse), every
run skips `--warmup` steps, one compute thread per process, median over all measured steps of non-pad tokens per
CPU second of the step (wall-clock rates are printed and saved too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PYTHON,
    RESULTS,
    ROOT,
    build_model,
    count_parameters,
    measured,
    recipe_order,
    run_recipe_timed,
    run_trl_worker,
    save_results,
    summary_line,
    trl_step_timer,
    write_preference_data,
)

OUT = RESULTS / "sft_vs_trl"
HYPER = {"learning_rate": 5e-4, "max_length": 1024, "max_grad_norm": 1.0, "seed": 42}
TRL_MODES = ("padded", "padding_free", "bfd")


def write_sft_rows(paired: Path, out: Path) -> None:
    """Preference row i -> SFT row i: {prompt, completion = chosen} (conversational prompt-completion)."""
    rows = map(json.loads, paired.read_text().splitlines())
    out.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in rows))


def our_layouts(model_dir: str, data: Path, order: list[list[int]], packing_length: int) -> dict:
    """Real tokens, learned tokens and laid-out slots of every step of ours, through the recipe's data path."""
    from types import SimpleNamespace

    from verl_kit.data import load_split, sft_examples
    from verl_kit.models import load_tokenizer
    from verl_kit.train import make_batch

    tok = load_tokenizer(model_dir)
    exs = sft_examples(load_split(str(data), "train"), tok, 256, HYPER["max_length"], str(data))
    out = {}
    for packing in (False, True):
        cfg = SimpleNamespace(packing=packing, packing_length=packing_length)
        batches = [make_batch([([exs[i].input_ids], [exs[i].loss_mask]) for i in idx], cfg, tok.pad_token_id, True)
                   for idx in order]
        out["packed" if packing else "padded"] = [{"tokens": b.num_tokens, "slots": b.input_ids.numel(), "learned":
                                                   int(b.scored.sum()), "shape": list(b.input_ids.shape)}
                                                  for b in batches]
    return out


def run_ours(args, model_dir: str, data: Path, packing: bool, tag: str) -> dict:
    out_dir = OUT / "runs" / tag
    cmd = [PYTHON, "recipes/sft.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
           "--dataset_test_split", "none", "--output_dir", str(out_dir), "--max_steps", str(args.warmup + args.steps),
           "--logging_steps", "1", "--per_device_train_batch_size", str(args.batch_size),
           "--packing", str(packing).lower(), "--packing_length", str(args.packing_length),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower(), "--max_prompt_length", "256",
           *[x for k, v in HYPER.items() for x in (f"--{k}", str(v))]]
    return run_recipe_timed(cmd, out_dir, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def run_trl(args, model_dir: str, data: Path, mode: str, tag: str) -> dict:
    out_json = OUT / "runs" / f"{tag}.json"
    cmd = [PYTHON, __file__, "trl-worker", "--model", model_dir, "--data", str(data), "--out", str(out_json),
           "--steps", str(args.warmup + args.steps), "--mode", mode, "--gradient_checkpointing",
           str(args.gradient_checkpointing).lower(), "--batch_size",
           str(args.trl_packed_rows if mode == "bfd" else args.batch_size)]
    return run_trl_worker(cmd, out_json, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (x rounds: >= 5 per configuration)")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each: ours, the TRL modes, ours)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per device per step (ours, TRL unpacked)")
    p.add_argument("--packing_length", type=int, default=512, help="ours' packed row length (recipe default 512)")
    p.add_argument("--trl_packed_rows", type=int, default=2, help="TRL bfd: packed rows per device per step")
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--run_timeout_s", type=float, default=300)
    args = p.parse_args(argv)
    t_start = time.time()
    OUT.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    model_dir = build_model()
    n_params = count_parameters(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_rows = (args.warmup + args.steps) * args.batch_size  # one epoch: every row is used exactly once
    paired, data = OUT / "data" / "paired.jsonl", OUT / "data" / "ours.jsonl"
    data_stats = write_preference_data(paired, tok, n_rows)  # lengths of prompt + chosen and of prompt + rejected
    write_sft_rows(paired, data)
    order = recipe_order(n_rows, args.warmup + args.steps, args.batch_size, HYPER["seed"])
    lines = data.read_text().splitlines()
    trl_data = OUT / "data" / "trl.jsonl"  # same rows, in the order ours reads them
    trl_data.write_text("\n".join(lines[i] for idx in order for i in idx) + "\n")
    (trl_bfd := OUT / "data" / "trl_bfd.jsonl").write_text(trl_data.read_text() * 2)  # bfd: fewer, fuller rows
    layouts = our_layouts(model_dir, data, order, args.packing_length)
    print(f"model: {n_params / 1e6:.1f}M parameters; data: {data_stats}", flush=True)

    runs = {"ours_padded": [], "ours_packed": [], **{f"trl_{m}": [] for m in TRL_MODES}}
    for r in range(args.rounds):
        first, second = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        runs[f"ours_{first}"].append(run_ours(args, model_dir, data, first == "packed", f"ours_{first}_{r}"))
        for m in TRL_MODES if r % 2 == 0 else TRL_MODES[::-1]:
            runs[f"trl_{m}"].append(run_trl(args, model_dir, trl_bfd if m == "bfd" else trl_data, m, f"trl_{m}_{r}"))
        runs[f"ours_{second}"].append(run_ours(args, model_dir, data, second == "packed", f"ours_{second}_{r}"))

    # Same rows per step (TRL padded and padding_free): real and learned token counts must agree with ours.
    ours_counts = {k: [s[k] for s in layouts["padded"]] for k in ("tokens", "learned")}
    for mode, k, got in [(m, k, res[k]) for m in TRL_MODES[:2] for res in runs[f"trl_{m}"] for k in ours_counts]:
        if got != ours_counts[k]:
            print(f"WARNING: TRL {mode} {k} {got} != ours {ours_counts[k]}: not the same batches", flush=True)
    w = args.warmup
    pad_frac = lambda steps: 1 - sum(s["tokens"] for s in steps[w:]) / sum(s["slots"] for s in steps[w:])
    results = {"config": {**vars(args), **HYPER, "parameters": n_params, "model": model_dir, "data": data_stats},
               "runs": runs, "layouts": layouts}
    for side in ("padded", "packed"):
        results[f"ours_{side}"] = {**measured(runs[f"ours_{side}"], w), "padding_fraction": pad_frac(layouts[side])}
    for m in TRL_MODES:
        steps = [{"tokens": t, "slots": s} for t, s in zip(runs[f"trl_{m}"][0]["tokens"], runs[f"trl_{m}"][0]["slots"])]
        results[f"trl_{m}"] = {**measured(runs[f"trl_{m}"], w), "padding_fraction": pad_frac(steps),
                               "row_length": max(runs[f"trl_{m}"][0]["row_length"])}
    best = max(("padding_free", "bfd"), key=lambda m: results[f"trl_{m}"]["tokens_per_cpu_s"])
    pairs = {"sft_vs_trl": ("ours_packed", f"trl_{best}"), "sft_padded_vs_trl": ("ours_padded", "trl_padded")}
    for name, (ours, trl) in pairs.items():
        results[name] = results[ours]["tokens_per_cpu_s"] / results[trl]["tokens_per_cpu_s"]
        results[f"{name}_wall"] = results[ours]["tokens_per_s"] / results[trl]["tokens_per_s"]
    results["bench_wall_s"] = time.time() - t_start
    tag = "_".join(a.lstrip("-") for a in (sys.argv[1:] if argv is None else argv))  # non-default runs kept apart
    path = save_results("sft_vs_trl" + (f"_{tag}" if tag else ""), results)

    print(f"\n== SFT vs TRL {n_params / 1e6:.1f}M params, batch {args.batch_size} sequences, {args.rounds} rounds x "
          f"{args.steps} measured steps (+{w} warm-up), median sequence {data_stats['median_tokens']} tokens ==")
    for key in ("ours_padded", "ours_packed", *(f"trl_{m}" for m in TRL_MODES)):
        r = results[key]
        print(f"{key:16s} {r['tokens_per_cpu_s']:7.1f} non-pad tokens/CPU-s  {r['tokens_per_s']:7.1f} tokens/wall-s  "
              f"step {r['step_time_s']:.2f}s  padding {100 * r['padding_fraction']:.1f}%  "
              f"({r['measured_steps']} steps)")
    print(f"results: {path.relative_to(ROOT)}  ({results['bench_wall_s']:.0f}s)")
    load = [r[k] for rs in runs.values() for r in rs for k in ("loadavg_before", "loadavg_after")]
    print(f"load average during the runs: {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} cores")
    print(summary_line("sft_padded_vs_trl", results["sft_padded_vs_trl"],
                       f"(wall {results['sft_padded_vs_trl_wall']:.3f})  padded vs TRL padded; target 1.0 +-5%"))
    print(summary_line("sft_vs_trl", results["sft_vs_trl"], f"(wall {results['sft_vs_trl_wall']:.3f})  ours packed "
                       f"vs TRL {best} (its faster padding-free mode); target >= 1.2"))


# ---- TRL side: an SFTTrainer run timed by a callback ----------------------------------------------------------------

def trl_worker(argv):
    p = argparse.ArgumentParser()
    for name in ("--model", "--data", "--out", "--mode"):
        p.add_argument(name, required=True)
    for name in ("--steps", "--batch_size"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    a = p.parse_args(argv)

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class CountingSFTTrainer(SFTTrainer):
        """Records real (padding-free: every position), learned and laid-out tokens per batch; changes nothing."""

        counts: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            real = int(mask.sum()) if mask is not None else ids.numel()
            self.counts.append((real, int((inputs["labels"] != -100).sum()), ids.numel(), ids.shape[1]))
            return super().training_step(model, inputs, num_items_in_batch)

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    cfg = SFTConfig(
        output_dir=os.path.join(os.path.dirname(a.out), "trl_out"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=HYPER["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=HYPER["max_grad_norm"],
        optim="adamw_torch", packing=a.mode == "bfd", packing_strategy="bfd", padding_free=a.mode == "padding_free",
        # bfd: the packed row length. Padding-free without packing refuses a max_length (it would not be enforced);
        # no row here exceeds 1024 tokens.
        max_length=None if a.mode == "padding_free" else HYPER["max_length"],
        completion_only_loss=True, gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, use_cpu=True, seed=HYPER["seed"],
        train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=10_000, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    train = datasets.load_dataset("json", data_files={"train": a.data}, split="train")
    timer = trl_step_timer()
    trainer = CountingSFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, callbacks=[timer])
    trainer.train()
    times, c = timer.step_times(), trainer.counts
    with open(a.out, "w") as f:
        json.dump({"step_time_s": times, "step_cpu_s": timer.step_cpu(), "tokens": [x[0] for x in c],
                   "learned": [x[1] for x in c], "slots": [x[2] for x in c], "row_length": [x[3] for x in c]}, f)
    print(f"trl {a.mode}: step times {[round(t, 2) for t in times]}, row lengths {[x[3] for x in c]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        trl_worker(sys.argv[2:])
    else:
        main()
