"""Reward-model throughput: `recipes/reward_model.py` against TRL's RewardTrainer, measured in the same run.

    python bench/rm_vs_trl.py                   # the whole comparison (5-10 minutes on 2 shared CPU cores)
    python bench/rm_vs_trl.py --rounds 1        # quicker, noisier

Both sides train the same ~20M-parameter Llama (bench/common.py) with a fresh one-label `score` head
(AutoModelForSequenceClassification) on the same synthetic preference rows (lognormal lengths, median ~200 tokens
per sequence), Bradley-Terry loss, the same per-device batch (4 pairs), optimizer, schedule and steps, and see the
same pairs per step in the same order (the TRL dataset is written in the order recipes/reward_model.py reads it, and
TRL reads it sequentially); the per-step token counts of both sides are checked to agree. A step is one forward of
the 8 sequences (chosen and rejected), the loss, a backward and an AdamW step on both sides.
TRL 1.16's RewardTrainer has no packing and no padding-free path (its collator right-pads chosen + rejected to the
longest of the batch; HF's classifier reads each row's reward at its last non-pad token), so TRL runs padded in both
comparisons. Ours: padded, or packed (best-fit into rows of `--packing_length` 512 under a 4D block-diagonal mask,
exact; the score head runs at every position and each sequence's reward is read at its own last token).
Runs alternate (ours padded, TRL, ours packed, then the reverse), every run skips `--warmup` steps, one compute
thread per process, median over all measured steps of non-pad tokens per CPU second of the step.
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

OUT = RESULTS / "rm_vs_trl"
HYPER = {"learning_rate": 5e-4, "max_length": 1024, "max_grad_norm": 1.0, "seed": 42}


def our_layouts(model_dir: str, data: Path, order: list[list[int]], packing_length: int) -> dict:
    """Real and laid-out token counts of every step of ours, padded and packed, through the recipe's data path."""
    from types import SimpleNamespace

    from verl_kit.data import load_split, preference_examples
    from verl_kit.models import load_tokenizer
    from verl_kit.train import completion_sequences, make_batch

    tok = load_tokenizer(model_dir)
    exs = preference_examples(load_split(str(data), "train"), tok, 256, HYPER["max_length"], str(data))
    out = {}
    for packing in (False, True):
        cfg = SimpleNamespace(packing=packing, packing_length=packing_length)
        rows = []
        for idx in order:
            b = make_batch([completion_sequences(exs[i].prompt_ids, [exs[i].chosen_ids, exs[i].rejected_ids])
                            for i in idx], cfg, tok.pad_token_id, True)
            rows.append({"tokens": b.num_tokens, "slots": b.input_ids.numel(), "shape": list(b.input_ids.shape)})
        out["packed" if packing else "padded"] = rows
    return out


def run_ours(args, model_dir: str, data: Path, packing: bool, tag: str) -> dict:
    out_dir = OUT / "runs" / tag
    cmd = [PYTHON, "recipes/reward_model.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
           "--dataset_test_split", "none", "--output_dir", str(out_dir), "--max_steps", str(args.warmup + args.steps),
           "--logging_steps", "1", "--per_device_train_batch_size", str(args.batch_size),
           "--packing", str(packing).lower(), "--packing_length", str(args.packing_length),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower(), "--max_prompt_length", "256",
           *[x for k, v in HYPER.items() for x in (f"--{k}", str(v))]]
    return run_recipe_timed(cmd, out_dir, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def run_trl(args, model_dir: str, data: Path, tag: str) -> dict:
    out_json = OUT / "runs" / f"{tag}.json"
    cmd = [PYTHON, __file__, "trl-worker", "--model", model_dir, "--data", str(data), "--out", str(out_json),
           "--steps", str(args.warmup + args.steps), "--batch_size", str(args.batch_size),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    return run_trl_worker(cmd, out_json, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run (x rounds: >= 5 per configuration)")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each: ours padded, TRL, ours packed)")
    p.add_argument("--batch_size", type=int, default=4, help="preference pairs per device per step (both sides)")
    p.add_argument("--packing_length", type=int, default=512, help="ours' packed row length (recipe default 512)")
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
    data = OUT / "data" / "ours.jsonl"
    data_stats = write_preference_data(data, tok, n_rows)
    order = recipe_order(n_rows, args.warmup + args.steps, args.batch_size, HYPER["seed"])
    rows = data.read_text().splitlines()
    trl_data = OUT / "data" / "trl.jsonl"  # same rows, in the order ours reads them
    trl_data.write_text("\n".join(rows[i] for idx in order for i in idx) + "\n")
    layouts = our_layouts(model_dir, data, order, args.packing_length)
    print(f"model: {n_params / 1e6:.1f}M parameters; data: {data_stats}", flush=True)

    runs = {"ours_padded": [], "ours_packed": [], "trl": []}
    for r in range(args.rounds):
        first, second = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        runs[f"ours_{first}"].append(run_ours(args, model_dir, data, first == "packed", f"ours_{first}_{r}"))
        runs["trl"].append(run_trl(args, model_dir, trl_data, f"trl_{r}"))
        runs[f"ours_{second}"].append(run_ours(args, model_dir, data, second == "packed", f"ours_{second}_{r}"))

    # Same pairs on both sides: the real-token counts per step must agree (ours' metrics, ours' layout, TRL's).
    for key in ("ours_padded", "ours_packed"):
        for res in runs[key]:
            if res["tokens"] != [s["tokens"] for s in layouts[key.split("_")[1]]]:
                print(f"WARNING: {key} logged tokens {res['tokens']} differ from its layout", flush=True)
    for res in runs["trl"]:
        if res["tokens"] != [s["tokens"] for s in layouts["padded"]]:
            print(f"WARNING: TRL tokens {res['tokens']} != ours {[s['tokens'] for s in layouts['padded']]}: the "
                  "two sides did not see identical batches", flush=True)

    w = args.warmup
    pad_frac = lambda steps: 1 - sum(s["tokens"] for s in steps[w:]) / sum(s["slots"] for s in steps[w:])
    trl_steps = [{"tokens": t, "slots": s} for t, s in zip(runs["trl"][0]["tokens"], runs["trl"][0]["slots"])]
    results = {
        "config": {**vars(args), **HYPER, "parameters": n_params, "model": model_dir, "data": data_stats},
        "ours_padded": {**measured(runs["ours_padded"], w), "padding_fraction": pad_frac(layouts["padded"])},
        "ours_packed": {**measured(runs["ours_packed"], w), "padding_fraction": pad_frac(layouts["packed"])},
        "trl_padded": {**measured(runs["trl"], w), "padding_fraction": pad_frac(trl_steps)},
        "runs": runs, "layouts": layouts,
    }
    names = {"padded": "rm_padded_vs_trl", "packed": "rm_vs_trl"}
    for side, name in names.items():
        ours, trl = results[f"ours_{side}"], results["trl_padded"]
        results[name] = ours["tokens_per_cpu_s"] / trl["tokens_per_cpu_s"]
        results[f"{name}_wall"] = ours["tokens_per_s"] / trl["tokens_per_s"]
    results["bench_wall_s"] = time.time() - t_start
    tag = "_".join(a.lstrip("-") for a in (sys.argv[1:] if argv is None else argv))  # non-default runs kept apart
    path = save_results("rm_vs_trl" + (f"_{tag}" if tag else ""), results)

    print(f"\n== Reward model vs TRL {n_params / 1e6:.1f}M params, batch {args.batch_size} pairs, {args.rounds} rounds "
          f"x {args.steps} measured steps (+{w} warm-up), median sequence {data_stats['median_tokens']} tokens ==")
    for key in ("ours_padded", "ours_packed", "trl_padded"):
        r = results[key]
        print(f"{key:12s} {r['tokens_per_cpu_s']:7.1f} non-pad tokens/CPU-s  {r['tokens_per_s']:7.1f} tokens/wall-s  "
              f"step {r['step_time_s']:.2f}s  padding {100 * r['padding_fraction']:.1f}%  "
              f"({r['measured_steps']} steps)")
    print(f"results: {path.relative_to(ROOT)}  ({results['bench_wall_s']:.0f}s)")
    load = [r[k] for rs in runs.values() for r in rs for k in ("loadavg_before", "loadavg_after")]
    print(f"load average during the runs: {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} cores")
    for side, target in (("padded", "padded vs TRL padded; target 1.0 +-5%"),
                         ("packed", "ours packed vs TRL padded (no packed mode); target >= 1.3")):
        print(summary_line(names[side], results[names[side]], f"(wall {results[names[side] + '_wall']:.3f})  {target}"))


# ---- TRL side: a RewardTrainer run timed by a callback --------------------------------------------------------------

def trl_worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    a = p.parse_args(argv)

    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    class CountingRewardTrainer(RewardTrainer):
        """Records the real (attention-mask) and laid-out token counts of every batch; nothing else changes."""

        batch_counts: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            m = inputs["attention_mask"]
            self.batch_counts.append((int(m.sum()), m.numel()))
            return super().training_step(model, inputs, num_items_in_batch)

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    cfg = RewardConfig(
        output_dir=os.path.join(os.path.dirname(a.out), "trl_out"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=HYPER["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=HYPER["max_grad_norm"],
        optim="adamw_torch", max_length=HYPER["max_length"], gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, use_cpu=True, seed=HYPER["seed"],
        train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=10_000, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    train = datasets.load_dataset("json", data_files={"train": a.data}, split="train")
    timer = trl_step_timer()
    trainer = CountingRewardTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok,
                                    callbacks=[timer])
    trainer.train()
    times, counts = timer.step_times(), trainer.batch_counts
    with open(a.out, "w") as f:
        json.dump({"step_time_s": times, "step_cpu_s": timer.step_cpu(), "tokens": [c[0] for c in counts],
                   "slots": [c[1] for c in counts]}, f)
    print(f"trl: {len(times)} steps, step times {[round(t, 2) for t in times]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        trl_worker(sys.argv[2:])
    else:
        main()
