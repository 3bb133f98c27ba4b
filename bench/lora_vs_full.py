"""LoRA (`--use_peft`) against full fine-tuning, and against TRL's DPOTrainer with the same peft_config.

    python bench/lora_vs_full.py                   # all three comparisons (~10 minutes on 2 CPU cores)
    python bench/lora_vs_full.py --rounds 1 --skip_state_bytes   # quicker, noisier
    python bench/lora_vs_full.py --lora_dropout 0                # no LoRA dropout on either side

Set up like bench/dpo_vs_trl.py (its model, data, batch order, hyper-parameters and layouts are imported): the ~20M
Llama, 4 pairs per step, reference log-probs precomputed on both sides, gradient checkpointing off, one compute
thread, figures = median over the measured steps of non-pad tokens per CPU-second (wall-clock rates in brackets).
LoRA is r=8, alpha=16, dropout 0.05 on every linear layer of the decoder (peft's all-linear, not the LM head).

- `lora_state_bytes_vs_full`: two `accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2`
  runs (inside `unshare -n`), full and LoRA, one AdamW step each; per rank, the bytes of distinct storages, split into
  trained-parameter copies, frozen-parameter shards, DeepSpeed's fp32 master partitions, gradients and AdamW state.
  The ratio is the trainable state (master + gradients + AdamW: what the optimizer holds for the trained parameters);
  the total per rank, frozen base shards included, is printed beside it.
- `lora_step_vs_full`: recipes/dpo.py packed, `--use_peft` against full fine-tuning, same batches (>1: LoRA faster).
- `dpo_lora_vs_trl` / `dpo_lora_padded_vs_trl`: recipes/dpo.py `--use_peft`, packed and padded, against TRL 1.16
  DPOTrainer (padded: it has no padding-free DPO) given the same LoraConfig. TRL's default `disable_dropout=True` would
  set the LoRA dropout (an nn.Dropout) to 0 while ours keeps it, so TRL gets `disable_dropout=False`: both sides run
  the same dropout (`--lora_dropout`, default 0.05 as the kit's and TRL ModelConfig's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    median,
    run,
    run_recipe_timed,
    run_trl_worker,
    save_results,
    summary_line,
    trl_step_timer,
    write_preference_data,
)
from dpo_vs_trl import HYPER, our_layouts, ours_order  # noqa: E402

OUT = RESULTS / "lora_vs_full"
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05}
CONFIGS = ("full_packed", "lora_packed", "trl_lora", "lora_padded")  # run order of even rounds, reversed in odd


def run_ours(args, model_dir: str, data: Path, name: str, tag: str) -> dict:
    out_dir = OUT / "runs" / tag
    lora = {**LORA, "lora_dropout": args.lora_dropout}
    lora = ["--use_peft", *[x for k, v in lora.items() for x in (f"--{k}", str(v))]] if "lora" in name else []
    cmd = [PYTHON, "recipes/dpo.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
           "--dataset_test_split", "none", "--output_dir", str(out_dir), "--max_steps", str(args.warmup + args.steps),
           "--logging_steps", "1", "--per_device_train_batch_size", str(args.batch_size),
           "--packing", str(name.endswith("packed")).lower(), "--packing_length", str(args.packing_length),
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower(), "--max_prompt_length", "256",
           *[x for k, v in HYPER.items() for x in (f"--{k}", str(v))], *lora]
    return run_recipe_timed(cmd, out_dir, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def run_trl(args, model_dir: str, data: Path, tag: str) -> dict:
    out_json = OUT / "runs" / f"{tag}.json"
    cmd = [PYTHON, __file__, "trl-worker", model_dir, str(data), str(out_json), str(args.warmup + args.steps),
           str(args.batch_size), str(args.gradient_checkpointing), str(args.lora_dropout)]
    return run_trl_worker(cmd, out_json, OUT / "logs" / f"{tag}.log", args.run_timeout_s, tag)


def state_bytes(args, model_dir: str) -> dict:
    out = {}
    for name in ("full", "lora"):
        out_json = OUT / "runs" / f"state_{name}.json"
        cmd = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml",
               "--num_processes", "2", "--main_process_port", "29741", __file__, "state-worker", model_dir,
               str(out_json), name]
        run(loopback_netns(cmd), OUT / "logs" / f"state_{name}.log", args.run_timeout_s, prefix=f"[state {name}] ")
        out[name] = json.loads(out_json.read_text())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the four configurations")
    p.add_argument("--batch_size", type=int, default=4, help="preference pairs per device per step (all sides)")
    p.add_argument("--gradient_checkpointing", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--packing_length", type=int, default=512, help="ours' packed row length (recipe default 512)")
    p.add_argument("--lora_dropout", type=float, default=LORA["lora_dropout"], help="both sides (TRL: 0 by default)")
    p.add_argument("--skip_state_bytes", action="store_true")
    p.add_argument("--run_timeout_s", type=float, default=400)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    model_dir = build_model()
    n_params, w = count_parameters(model_dir), args.warmup
    n_rows = (w + args.steps) * args.batch_size
    data = OUT / "data" / "ours.jsonl"
    data_stats = write_preference_data(data, AutoTokenizer.from_pretrained(model_dir), n_rows)
    order = ours_order(n_rows, w + args.steps, args.batch_size)
    rows = data.read_text().splitlines()
    trl_data = OUT / "data" / "trl.jsonl"  # same rows, in the order ours reads them
    trl_data.write_text("\n".join(rows[i] for idx in order for i in idx) + "\n")
    layouts = our_layouts(model_dir, data, order, args.packing_length)

    runs = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for c in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            tag = f"{c}_{r}"
            runs[c].append(run_trl(args, model_dir, trl_data, tag) if c == "trl_lora" else
                           run_ours(args, model_dir, data, c, tag))
    for c in CONFIGS:
        want = [s["tokens"] for s in layouts["packed" if c.endswith("packed") else "padded"]]
        if any(res["tokens"] != want for res in runs[c]):
            print(f"WARNING: {c}: tokens per step {runs[c][0]['tokens']} != ours {want}: not the same batches")

    cpu_step = lambda rs: median([c for r in rs for c in r["step_cpu_s"][w:]])
    res = {c: {**measured(runs[c], w), "cpu_s_per_step": cpu_step(runs[c])} for c in CONFIGS}
    ratio = lambda a, b, k="tokens_per_cpu_s": res[a][k] / res[b][k]
    lines = [("lora_step_vs_full", "lora_packed", "full_packed", "(>1: LoRA faster)"),
             ("dpo_lora_vs_trl", "lora_packed", "trl_lora", "target >= 1.3"),
             ("dpo_lora_padded_vs_trl", "lora_padded", "trl_lora", "target 1.0 +-5%")]
    results = {"config": {**LORA, **vars(args), **HYPER, "parameters": n_params, "data": data_stats}, **res,
               **{n: ratio(a, b) for n, a, b, _ in lines}, "runs": runs}
    if not args.skip_state_bytes:
        sb = results["state_bytes"] = state_bytes(args, model_dir)
        peak = lambda name, key: max(r[key] for r in sb[name]["ranks"])
        results["lora_state_bytes_vs_full"] = peak("lora", "trainable_state_bytes") / peak("full",
                                                                                            "trainable_state_bytes")
        results["lora_total_bytes_vs_full"] = peak("lora", "total_bytes") / peak("full", "total_bytes")
    tag = "_".join(a.lstrip("-") for a in sys.argv[1:])  # non-default runs kept apart
    path = save_results("lora_vs_full" + (f"_{tag}" if tag else ""), results)

    print(f"\n== LoRA r={LORA['lora_r']} (dropout {args.lora_dropout}) vs full, DPO {n_params / 1e6:.1f}M params, "
          f"{args.batch_size} pairs/step, {args.rounds} rounds x {args.steps} measured steps (+{w} warm-up), "
          f"median sequence {data_stats['median_tokens']} tokens ==")
    for c in CONFIGS:
        r = res[c]
        print(f"{c:12s} {r['tokens_per_cpu_s']:7.1f} non-pad tokens/CPU-s  {r['tokens_per_s']:7.1f} tokens/wall-s  "
              f"{r['cpu_s_per_step']:.2f} CPU-s/step  ({r['measured_steps']} steps)")
    for name in ("full", "lora") if "state_bytes" in results else ():
        r0 = {k: v / 2**20 if k.endswith("bytes") else v for k, v in results["state_bytes"][name]["ranks"][0].items()}
        print(f"{name:5s} rank 0: {r0['trainable_params'] / 1e6:.3f}M trainable params; trainable state "
              f"{r0['trainable_state_bytes']:.2f} MiB (fp32 master {r0['master_bytes']:.2f}, grads "
              f"{r0['grad_bytes']:.2f}, AdamW {r0['optimizer_bytes']:.2f}); trained param copies "
              f"{r0['trained_param_bytes']:.2f}, frozen shards {r0['frozen_param_bytes']:.2f}; total "
              f"{r0['total_bytes']:.2f} MiB")
    load = [r[k] for rs in runs.values() for r in rs for k in ("loadavg_before", "loadavg_after")]
    print(f"results: {path.relative_to(ROOT)}; load average {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} cores")
    if "lora_state_bytes_vs_full" in results:
        print(summary_line("lora_state_bytes_vs_full", results["lora_state_bytes_vs_full"],
                           f"(total per rank incl. frozen base shards {results['lora_total_bytes_vs_full']:.3f})  "
                           "target <= 0.05"))
    for n, a, b, target in lines:
        print(summary_line(n, results[n], f"(wall {ratio(a, b, 'tokens_per_s'):.3f})  {target}"))


def trl_worker(model_dir, data, out, steps, batch_size, gradient_checkpointing, lora_dropout):
    """TRL DPOTrainer with a LoraConfig, otherwise configured as dpo_vs_trl.py's TRL worker."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class CountingDPOTrainer(DPOTrainer):
        batch_counts: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            m = inputs["attention_mask"]
            self.batch_counts.append((int(m.sum()), m.numel()))
            return super().training_step(model, inputs, num_items_in_batch)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    cfg = DPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl_out"), per_device_train_batch_size=int(batch_size),
        max_steps=int(steps), learning_rate=HYPER["learning_rate"], lr_scheduler_type="linear", weight_decay=0.0,
        max_grad_norm=HYPER["max_grad_norm"], optim="adamw_torch", beta=HYPER["beta"], loss_type=["sigmoid"],
        max_length=HYPER["max_length"], precompute_ref_log_probs=True, precompute_ref_batch_size=16,
        gradient_checkpointing=gradient_checkpointing == "True", gradient_checkpointing_kwargs={"use_reentrant": False},
        disable_dropout=False, bf16=False, use_cpu=True, seed=HYPER["seed"], train_sampling_strategy="sequential",
        dataloader_num_workers=0, logging_steps=10_000, save_strategy="no", report_to="none", disable_tqdm=True)
    peft_config = LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], lora_dropout=float(lora_dropout),
                             target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
    timer = trl_step_timer()
    trainer = CountingDPOTrainer(model=model, args=cfg, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                 train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
                                 peft_config=peft_config, callbacks=[timer])
    trainer.model.print_trainable_parameters()
    trainer.train()
    counts = trainer.batch_counts
    Path(out).write_text(json.dumps({"step_time_s": timer.step_times(), "step_cpu_s": timer.step_cpu(),
                                     "tokens": [c[0] for c in counts], "slots": [c[1] for c in counts]}))


def state_worker(model_dir, out, name):
    """One AdamW step under ZeRO-3 (full or LoRA), then this rank's bytes of distinct storages by role, as
    dpo_vs_trl.py's state worker counts them; a storage is counted once, under its first role."""
    import torch

    from verl_kit.config import TrainConfig
    from verl_kit.models import load_causal_lm, with_lora
    from verl_kit.train import Trainable, destroy, make_accelerator, zero_stage

    cfg = TrainConfig(model_name_or_path=model_dir, output_dir=os.path.join(os.path.dirname(out), "state_out"),
                      per_device_train_batch_size=2, use_peft=name == "lora", **LORA)
    accelerator = make_accelerator(cfg)
    policy = Trainable(accelerator, with_lora(load_causal_lm(model_dir, "sdpa"), cfg), cfg, 1e-4, 1)
    assert zero_stage(accelerator) == 3, "launch with accelerate_configs/zero3.yaml"
    ids = torch.randint(0, policy.unwrapped().config.vocab_size, (2, 128),
                        generator=torch.Generator().manual_seed(accelerator.process_index))
    for _ in policy.accumulate([ids]):
        policy.backward(policy.model(input_ids=ids, labels=ids).loss)
    policy.step()

    ds_opt, params = policy.model.optimizer, list(policy.model.parameters())
    local = lambda qs: [q.ds_tensor for q in qs] + [q.data for q in qs if q.ds_persist]  # shard (+ whole if small)
    trained, frozen = [q for q in params if q.requires_grad], [q for q in params if not q.requires_grad]
    adam = [v for st in ds_opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    roles = {"trained_param_bytes": local(trained), "frozen_param_bytes": local(frozen),
             "master_bytes": list(ds_opt.fp32_partitioned_groups_flat),
             "grad_bytes": [ds_opt.grad_partitions_flat_buffer] + [q.grad for q in params]
             + [f.grad for f in ds_opt.fp32_partitioned_groups_flat],
             "optimizer_bytes": adam}
    seen, mine = set(), {"rank": accelerator.process_index, "trainable_params": sum(q.ds_numel for q in trained),
                         "params": sum(q.ds_numel for q in params)}
    for role, tensors in roles.items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if t is not None and t.numel() > 0}
        mine[role] = sum(v for k, v in storages.items() if k not in seen)
        seen |= storages.keys()
    mine["trainable_state_bytes"] = mine["master_bytes"] + mine["grad_bytes"] + mine["optimizer_bytes"]
    mine["total_bytes"] = sum(mine[r] for r in roles)
    ranks = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps({"ranks": ranks}))
        print(json.dumps(ranks))
    destroy()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("trl-worker", "state-worker"):
        (trl_worker if sys.argv[1] == "trl-worker" else state_worker)(*sys.argv[2:])
    else:
        main()
