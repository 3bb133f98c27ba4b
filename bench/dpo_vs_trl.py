"""DPO throughput and memory: `recipes/dpo.py` against TRL's DPOTrainer, measured in the same run.

    python bench/dpo_vs_trl.py                  # the whole comparison (a few minutes on 2 CPU cores)
    python bench/dpo_vs_trl.py --rounds 1 --skip_state_bytes   # quicker, noisier

Both sides train the same ~20M-parameter Llama on the same synthetic preference data (lognormal lengths, median ~200
tokens per sequence), with the same per-device batch, optimizer, schedule and steps, and see the same batches in the
same order (the TRL dataset is written in the order recipes/dpo.py reads it, and TRL reads it sequentially). Both use
precomputed reference log-probs, so a training step is one policy forward + backward + AdamW step on both sides.
Runs alternate (ours padded, TRL, ours packed, then the reverse), every run skips `--warmup` steps, and the figure
reported is the median over all measured steps of non-pad tokens per second of the step. Every process runs one
compute thread, and the ratios use the CPU seconds of each step (the rate on an idle core): on a shared machine the
wall clock mostly measures the other jobs. Wall-clock rates and ratios are printed and saved beside them.

TRL 1.16's DPOTrainer has no padding-free path (`padding_free=True` warns and falls back to padding), so TRL runs
padded in both comparisons. ZeRO-3 memory: two 2-process runs (ZeRO-3 and DDP) each take one AdamW step and sum the
bytes of the parameters, gradients and optimizer state one rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    loopback_netns,
    measured,
    run,
    run_recipe_timed,
    run_trl_worker,
    save_results,
    summary_line,
    trl_step_timer,
    write_preference_data,
)

OUT = RESULTS / "dpo_vs_trl"
HYPER = {"learning_rate": 5e-4, "beta": 0.1, "max_length": 1024, "max_grad_norm": 1.0, "seed": 42}


# ---- orchestration --------------------------------------------------------------------------------------------------

def ours_order(n_rows: int, steps: int, batch: int) -> list[list[int]]:
    """Row indices of each step as recipes/dpo.py reads them (one process)."""
    from verl_kit.train import step_indices

    return [step_indices(n_rows, s, batch, HYPER["seed"], 0, 1) for s in range(steps)]


def our_layouts(model_dir: str, data: Path, order: list[list[int]], packing_length: int) -> dict:
    """Real and laid-out token counts of every step of ours, padded and packed, using the recipe's own data path and
    layout (so the padding fraction is exactly what the recipe runs)."""
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
    cmd = [PYTHON, "recipes/dpo.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
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


def state_bytes(args, model_dir: str) -> dict:
    """Per-rank model-state bytes under ZeRO-3 x2 and DDP x2, each from a real 2-process run."""
    out = {}
    # No `--cpu`: with it accelerate's simple launcher starts ONE process. Without CUDA, torchrun's two processes
    # come up as MULTI_CPU over gloo.
    for name, config in (("zero3", "zero3.yaml"), ("ddp", "ddp.yaml")):
        out_json = OUT / "runs" / f"state_{name}.json"
        cmd = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
               "--num_processes", "2", "--main_process_port", "29731", __file__, "state-worker", "--model", model_dir,
               "--out", str(out_json)]
        run(loopback_netns(cmd), OUT / "logs" / f"state_{name}.log", args.run_timeout_s, prefix=f"[state {name}] ")
        with open(out_json) as f:
            out[name] = json.load(f)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each: ours padded, TRL, ours packed)")
    p.add_argument("--batch_size", type=int, default=4, help="preference pairs per device per step (both sides)")
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--packing_length", type=int, default=512, help="ours' packed row length (recipe default 512)")
    p.add_argument("--skip_state_bytes", action="store_true")
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
    order = ours_order(n_rows, args.warmup + args.steps, args.batch_size)
    rows = data.read_text().splitlines()
    trl_data = OUT / "data" / "trl.jsonl"  # same rows, in the order ours reads them
    trl_data.write_text("\n".join(rows[i] for idx in order for i in idx) + "\n")
    layouts = our_layouts(model_dir, data, order, args.packing_length)
    print(f"model: {n_params / 1e6:.1f}M parameters; data: {data_stats}", flush=True)

    runs = {"ours_padded": [], "ours_packed": [], "trl": []}
    for r in range(args.rounds):
        ours_first = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        runs[f"ours_{ours_first[0]}"].append(run_ours(args, model_dir, data, ours_first[0] == "packed",
                                                      f"ours_{ours_first[0]}_{r}"))
        runs["trl"].append(run_trl(args, model_dir, trl_data, f"trl_{r}"))
        runs[f"ours_{ours_first[1]}"].append(run_ours(args, model_dir, data, ours_first[1] == "packed",
                                                      f"ours_{ours_first[1]}_{r}"))

    # Same batches on both sides: the real-token counts per step must agree (ours' metrics, ours' layout, TRL's).
    for key in ("ours_padded", "ours_packed"):
        for res in runs[key]:
            if res["tokens"] != [s["tokens"] for s in layouts[key.split("_")[1]]]:
                print(f"WARNING: {key} logged tokens {res['tokens']} differ from its layout", flush=True)
    if runs["trl"][0]["tokens"] != runs["ours_padded"][0]["tokens"]:
        print(f"WARNING: TRL tokens {runs['trl'][0]['tokens']} != ours {runs['ours_padded'][0]['tokens']}: "
              "the two sides did not see identical batches", flush=True)

    w = args.warmup
    pad_frac = lambda steps: 1 - sum(s["tokens"] for s in steps[w:]) / sum(s["slots"] for s in steps[w:])
    trl_res = runs["trl"][0]
    results = {
        "config": {**vars(args), **HYPER, "parameters": n_params, "model": model_dir, "data": data_stats},
        "ours_padded": {**measured(runs["ours_padded"], w), "padding_fraction": pad_frac(layouts["padded"])},
        "ours_packed": {**measured(runs["ours_packed"], w), "padding_fraction": pad_frac(layouts["packed"])},
        "trl_padded": {**measured(runs["trl"], w), "padding_fraction": 1 - sum(trl_res["tokens"][w:]) /
                       sum(trl_res["slots"][w:])},
        "runs": runs, "layouts": layouts,
    }
    for side in ("padded", "packed"):
        ours, trl = results[f"ours_{side}"], results["trl_padded"]
        results[f"dpo_{side}_vs_trl"] = ours["tokens_per_cpu_s"] / trl["tokens_per_cpu_s"]
        results[f"dpo_{side}_vs_trl_wall"] = ours["tokens_per_s"] / trl["tokens_per_s"]
    if not args.skip_state_bytes:
        sb = state_bytes(args, model_dir)
        results["state_bytes"] = sb
        results["zero3_state_bytes_vs_ddp"] = sb["zero3"]["max_rank_model_state_bytes"] / \
            sb["ddp"]["max_rank_model_state_bytes"]
    results["bench_wall_s"] = time.time() - t_start
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    results["bench_children_cpu_s"] = ru.ru_utime + ru.ru_stime
    tag = "_".join(a.lstrip("-") for a in (sys.argv[1:] if argv is None else argv))  # non-default runs kept apart
    path = save_results("dpo_vs_trl" + (f"_{tag}" if tag else ""), results)

    print(f"\n== DPO vs TRL {n_params / 1e6:.1f}M params, batch {args.batch_size} pairs, {args.rounds} rounds x "
          f"{args.steps} measured steps (+{w} warm-up), median sequence {data_stats['median_tokens']} tokens ==")
    for key in ("ours_padded", "ours_packed", "trl_padded"):
        r = results[key]
        print(f"{key:12s} {r['tokens_per_cpu_s']:7.1f} non-pad tokens/CPU-s  {r['tokens_per_s']:7.1f} tokens/wall-s  "
              f"step {r['step_time_s']:.2f}s  padding {100 * r['padding_fraction']:.1f}%  "
              f"({r['measured_steps']} steps)")
    if "state_bytes" in results:
        for name in ("zero3", "ddp"):
            s = results["state_bytes"][name]
            r0 = {k: v / 2**20 for k, v in s["ranks"][0].items() if k.endswith("_bytes")}
            print(f"{name:12s} per-rank model state {s['max_rank_model_state_bytes'] / 2**20:.1f} MiB (rank 0: params "
                  f"{r0['param_bytes']:.1f}, grads {r0['grad_bytes']:.1f}, optimizer {r0['optimizer_bytes']:.1f} MiB)")
    print(f"results: {path.relative_to(ROOT)}  (wall {results['bench_wall_s']:.0f}s, CPU of all child processes "
          f"{results['bench_children_cpu_s']:.0f}s)")
    load = [r[k] for rs in runs.values() for r in rs for k in ("loadavg_before", "loadavg_after")]
    print(f"load average during the runs: {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} cores "
          "(ratios are per CPU-second; wall-clock ratios, noisier under load, in brackets)")
    for side, target in (("padded", "target 1.0 +-5%"), ("packed", "target >= 1.5")):
        print(summary_line(f"dpo_{side}_vs_trl", results[f"dpo_{side}_vs_trl"],
                           f"(wall {results[f'dpo_{side}_vs_trl_wall']:.3f})  {target}"))
    if "zero3_state_bytes_vs_ddp" in results:
        print(summary_line("zero3_state_bytes_vs_ddp", results["zero3_state_bytes_vs_ddp"], "target <= 0.55"))


# ---- TRL side: a DPOTrainer run timed by a callback -----------------------------------------------------------------

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
    from trl import DPOConfig, DPOTrainer

    class CountingDPOTrainer(DPOTrainer):
        """Records the real (attention-mask) and laid-out token counts of every batch; nothing else changes."""

        batch_counts: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            m = inputs["attention_mask"]
            self.batch_counts.append((int(m.sum()), m.numel()))
            return super().training_step(model, inputs, num_items_in_batch)

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    cfg = DPOConfig(
        output_dir=os.path.join(os.path.dirname(a.out), "trl_out"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=HYPER["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=HYPER["max_grad_norm"],
        optim="adamw_torch", beta=HYPER["beta"], loss_type=["sigmoid"], max_length=HYPER["max_length"],
        precompute_ref_log_probs=True, precompute_ref_batch_size=16, gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, use_cpu=True, seed=HYPER["seed"],
        train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=10_000, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    train = datasets.load_dataset("json", data_files={"train": a.data}, split="train")
    timer = trl_step_timer()
    trainer = CountingDPOTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, callbacks=[timer])
    trainer.train()
    times, cpu = timer.step_times(), timer.step_cpu()
    counts = trainer.batch_counts
    with open(a.out, "w") as f:
        json.dump({"step_time_s": times, "step_cpu_s": cpu, "tokens": [c[0] for c in counts],
                   "slots": [c[1] for c in counts]}, f)
    print(f"trl: {len(times)} steps, step times {[round(t, 2) for t in times]}")


# ---- memory: per-rank model state under accelerate (ZeRO-3 or DDP) -------------------------------------------------

def state_worker(argv):
    """One AdamW step under the accelerate config this process was launched with; then sum, on this rank, the bytes
    of every distinct storage holding parameters (ZeRO-3: the local partitions, plus persistent small parameters),
    gradients (ZeRO-3: the flat gradient-partition buffer) and optimizer state."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    import torch

    from verl_kit.config import TrainConfig
    from verl_kit.models import load_causal_lm
    from verl_kit.train import Trainable, destroy, make_accelerator, zero_stage

    cfg = TrainConfig(model_name_or_path=a.model, output_dir=os.path.join(os.path.dirname(a.out), "state_out"),
                      per_device_train_batch_size=2)
    accelerator = make_accelerator(cfg)
    policy = Trainable(accelerator, load_causal_lm(a.model, "sdpa", gradient_checkpointing=False), cfg, 1e-4, 1)
    model, optimizer = policy.model, policy.optimizer
    g = torch.Generator().manual_seed(accelerator.process_index)
    ids = torch.randint(0, policy.unwrapped().config.vocab_size, (2, 128), generator=g)
    for _ in policy.accumulate([ids]):
        policy.backward(model(input_ids=ids, labels=ids).loss)
    policy.step()

    def storages(tensors) -> dict[int, int]:
        out = {}
        for t in tensors:
            if t is not None and t.numel() > 0:
                s = t.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
        return out

    params = list(model.parameters())
    if zero_stage(accelerator) == 3:
        ds_opt = model.optimizer
        # A non-persistent parameter's full tensor is a working buffer gathered for compute (like activations);
        # it is reported apart, not counted as state. Persistent (small) parameters stay whole on every rank.
        param_st = storages([q.ds_tensor for q in params] + [q.data for q in params if q.ds_persist]
                            + list(ds_opt.fp32_partitioned_groups_flat))
        gathered_st = storages([q.data for q in params if not q.ds_persist])
        grad_st = storages([ds_opt.grad_partitions_flat_buffer] + [q.grad for q in params]
                           + [f.grad for f in ds_opt.fp32_partitioned_groups_flat])
        opt_state = ds_opt.optimizer.state
    else:
        param_st = storages([q.data for q in params])
        gathered_st = {}
        grad_st = storages([q.grad for q in params])
        opt_state = optimizer.optimizer.state if hasattr(optimizer, "optimizer") else optimizer.state
    opt_st = storages([v for st in opt_state.values() for v in st.values() if torch.is_tensor(v)])
    grad_st = {k: v for k, v in grad_st.items() if k not in param_st}  # a storage is counted once
    opt_st = {k: v for k, v in opt_st.items() if k not in param_st and k not in grad_st}
    mine = {"rank": accelerator.process_index, "zero_stage": zero_stage(accelerator),
            "param_bytes": sum(param_st.values()), "grad_bytes": sum(grad_st.values()),
            "optimizer_bytes": sum(opt_st.values()),
            "gathered_param_bytes_at_measurement": sum(v for k, v in gathered_st.items() if k not in param_st),
            "full_param_bytes": sum(getattr(q, "ds_numel", q.numel()) * q.element_size() for q in params)}
    mine["model_state_bytes"] = mine["param_bytes"] + mine["grad_bytes"] + mine["optimizer_bytes"]
    ranks = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        with open(a.out, "w") as f:
            json.dump({"ranks": ranks, "max_rank_model_state_bytes": max(r["model_state_bytes"] for r in ranks)}, f)
        print(json.dumps(ranks))
    destroy()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        trl_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "state-worker":
        state_worker(sys.argv[2:])
    else:
        main()
