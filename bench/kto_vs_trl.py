"""KTO throughput: `recipes/kto.py` against TRL's KTOTrainer, measured in the same run.

    python bench/kto_vs_trl.py                  # the whole comparison (a few minutes on 2 CPU cores)
    python bench/kto_vs_trl.py --rounds 1       # quicker, noisier

Both sides train the same ~20M-parameter Llama (bench/common.py) on the same unpaired data (the synthetic preference
rows of bench/common.py, lognormal lengths, median ~200 tokens per sequence, each row split into a desirable and an
undesirable example), with the same per-device batch, optimizer, schedule and steps, and see the same examples per
step (the TRL dataset is written in the order recipes/kto.py reads it, and TRL reads it sequentially). Both use
precomputed reference log-probs (target and KL sequences), so a step is a forward of the KL sequences plus a forward
and backward of the target sequences plus an AdamW step on both sides. The KL sequences differ in pairing only: TRL
rotates completions within the batch, ours pairs each example with a fixed other one; each side counts its own
non-pad tokens of target + KL sequences.
Runs alternate (ours padded, TRL, ours packed, then the reverse), every run skips `--warmup` steps. As in the DPO
bench, each process runs one compute thread and the ratios use the median over all measured steps of non-pad tokens
per CPU second of the step (the rate on an idle core: on a shared machine the wall clock mostly measures the other
jobs); tokens per wall second are printed and saved too. TRL 1.16's KTOTrainer has no padding-free path, so TRL runs
padded in both comparisons.
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
    run_recipe_timed,
    run_trl_worker,
    save_results,
    summary_line,
    trl_step_timer,
    write_preference_data,
)

OUT = RESULTS / "kto_vs_trl"
HYPER = {"learning_rate": 5e-4, "beta": 0.1, "max_length": 1024, "max_grad_norm": 1.0, "seed": 42}


def write_unpaired(paired: Path, out: Path) -> None:
    """Paired row i -> unpaired rows 2i (chosen, desirable) and 2i+1 (rejected, undesirable)."""
    rows = [json.loads(line) for line in paired.read_text().splitlines()]
    with open(out, "w") as f:
        for r in rows:
            for key, label in (("chosen", True), ("rejected", False)):
                f.write(json.dumps({"prompt": r["prompt"], "completion": r[key], "label": label}) + "\n")


def ours_order(n_rows: int, steps: int, batch: int) -> list[list[int]]:
    """Row indices of each step as recipes/kto.py reads them (one process)."""
    from verl_kit.train import step_indices

    return [step_indices(n_rows, s, batch, HYPER["seed"], 0, 1) for s in range(steps)]


def our_target_tokens(model_dir: str, data: Path, order: list[list[int]]) -> list[int]:
    """Non-pad tokens of each step's target sequences (prompt + completion), through the recipe's own data path."""
    from verl_kit.data import load_split, unpaired_examples
    from verl_kit.models import load_tokenizer

    exs = unpaired_examples(load_split(str(data), "train"), load_tokenizer(model_dir), 256, HYPER["max_length"],
                            str(data))
    return [sum(len(exs[i].prompt_ids) + len(exs[i].completion_ids) for i in idx) for idx in order]


def run_ours(args, model_dir: str, data: Path, packing: bool, tag: str) -> dict:
    out_dir = OUT / "runs" / tag
    cmd = [PYTHON, "recipes/kto.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
           "--dataset_test_split", "none", "--output_dir", str(out_dir), "--max_steps", str(args.warmup + args.steps),
           "--logging_steps", "1", "--per_device_train_batch_size", str(args.batch_size),
           "--packing", str(packing).lower(), "--gradient_checkpointing", str(args.gradient_checkpointing).lower(),
           "--max_prompt_length", "256", *[x for k, v in HYPER.items() for x in (f"--{k}", str(v))]]
    return run_recipe_timed(cmd, out_dir, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def run_trl(args, model_dir: str, data: Path, tag: str) -> dict:
    out_json = OUT / "runs" / f"{tag}.json"
    cmd = [PYTHON, __file__, "trl-worker", "--model", model_dir, "--data", str(data), "--out", str(out_json),
           "--steps", str(args.warmup + args.steps), "--batch_size", str(args.batch_size),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    return run_trl_worker(cmd, out_json, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (x rounds: >= 5 per configuration)")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each: ours padded, TRL, ours packed)")
    p.add_argument("--batch_size", type=int, default=4, help="unpaired examples per device per step (both sides)")
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--run_timeout_s", type=float, default=300)
    args = p.parse_args(argv)
    t_start = time.time()
    OUT.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    model_dir = build_model()
    n_params = count_parameters(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_examples = (args.warmup + args.steps) * args.batch_size  # one epoch: every example is used exactly once
    paired = OUT / "data" / "paired.jsonl"
    data_stats = write_preference_data(paired, tok, n_examples // 2 + 1)
    data = OUT / "data" / "ours.jsonl"
    write_unpaired(paired, data)
    lines = data.read_text().splitlines()[:n_examples]
    data.write_text("\n".join(lines) + "\n")
    trl_data = OUT / "data" / "trl.jsonl"  # same examples, in the order ours reads them
    order = ours_order(n_examples, args.warmup + args.steps, args.batch_size)
    trl_data.write_text("\n".join(lines[i] for idx in order for i in idx) + "\n")
    print(f"model: {n_params / 1e6:.1f}M parameters; data: {data_stats}", flush=True)

    runs = {"ours_padded": [], "ours_packed": [], "trl": []}
    for r in range(args.rounds):
        first, second = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        runs[f"ours_{first}"].append(run_ours(args, model_dir, data, first == "packed", f"ours_{first}_{r}"))
        runs["trl"].append(run_trl(args, model_dir, trl_data, f"trl_{r}"))
        runs[f"ours_{second}"].append(run_ours(args, model_dir, data, second == "packed", f"ours_{second}_{r}"))

    # Same examples per step: the target tokens agree exactly; KL tokens differ by pairing only (see docstring).
    ours_target = our_target_tokens(model_dir, data, order)
    for res in runs["trl"]:
        if res["target_tokens"] != ours_target:
            print(f"WARNING: TRL target tokens {res['target_tokens']} != ours {ours_target}: the two sides did not "
                  "see identical batches", flush=True)
    w = args.warmup
    results = {"config": {**vars(args), **HYPER, "parameters": n_params, "model": model_dir, "data": data_stats},
               "ours_padded": measured(runs["ours_padded"], w), "ours_packed": measured(runs["ours_packed"], w),
               "trl_padded": measured(runs["trl"], w), "runs": runs}
    trl_tps = results["trl_padded"]["tokens_per_cpu_s"]
    results["kto_padded_vs_trl"] = results["ours_padded"]["tokens_per_cpu_s"] / trl_tps
    results["kto_packed_vs_trl"] = results["ours_packed"]["tokens_per_cpu_s"] / trl_tps
    wall = {k: results[f"ours_{k}"]["tokens_per_s"] / results["trl_padded"]["tokens_per_s"] for k in ("padded",
                                                                                                       "packed")}
    results["bench_wall_s"] = time.time() - t_start
    path = save_results("kto_vs_trl", results)

    print(f"\n== KTO vs TRL {n_params / 1e6:.1f}M params, batch {args.batch_size} examples, {args.rounds} rounds x "
          f"{args.steps} measured steps (+{w} warm-up), median sequence {data_stats['median_tokens']} tokens ==")
    for key in ("ours_padded", "ours_packed", "trl_padded"):
        r = results[key]
        print(f"{key:12s} {r['tokens_per_cpu_s']:8.1f} non-pad tokens/CPU-s  {r['tokens_per_s']:8.1f} tokens/wall-s  "
              f"step {r['step_time_s']:.2f}s  ({r['measured_steps']} steps)")
    print(f"results: {path.relative_to(ROOT)}  ({results['bench_wall_s']:.0f}s)")
    print(summary_line("kto_padded_vs_trl", results["kto_padded_vs_trl"],
                       f"(wall {wall['padded']:.3f})  padding on both sides"))
    print(summary_line("kto_vs_trl", results["kto_packed_vs_trl"],
                       f"(wall {wall['packed']:.3f})  ours packed vs TRL padded; target >= 1.5"))


# ---- TRL side: a KTOTrainer run timed by a callback -----------------------------------------------------------------

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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    class CountingKTOTrainer(KTOTrainer):
        """Records the real (attention-mask) token counts of the target and KL sequences; nothing else changes."""

        counts: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            m, kl = inputs["attention_mask"], inputs["KL_attention_mask"]
            self.counts.append((m.sum(1).tolist(), int(kl.sum())))
            return super().training_step(model, inputs, num_items_in_batch)

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    cfg = KTOConfig(
        output_dir=os.path.join(os.path.dirname(a.out), "trl_out"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=HYPER["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=HYPER["max_grad_norm"],
        optim="adamw_torch", beta=HYPER["beta"], desirable_weight=1.0, undesirable_weight=1.0,
        max_length=HYPER["max_length"], precompute_ref_log_probs=True, gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, use_cpu=True, seed=HYPER["seed"],
        train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=10_000, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    train = datasets.load_dataset("json", data_files={"train": a.data}, split="train")
    timer = trl_step_timer()
    trainer = CountingKTOTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, callbacks=[timer])
    trainer.train()
    times = timer.step_times()
    by_example = [c[0] for c in trainer.counts]
    with open(a.out, "w") as f:
        json.dump({"step_time_s": times, "step_cpu_s": timer.step_cpu(),
                   "tokens": [sum(t) + kl for t, kl in trainer.counts],
                   "target_tokens": [sum(t) for t in by_example], "kl_tokens": [kl for _, kl in trainer.counts]}, f)
    print(f"trl: {len(times)} steps, step times {[round(t, 2) for t in times]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        trl_worker(sys.argv[2:])
    else:
        main()
