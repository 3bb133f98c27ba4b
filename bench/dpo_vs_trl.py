"""DPO throughput and memory: `recipes/dpo.py` against TRL's DPOTrainer, measured in the same run.

    python bench/dpo_vs_trl.py                  # the whole comparison (a few minutes on 2 CPU cores)
    python bench/dpo_vs_trl.py --rounds 1 --skip_sharded   # quicker, noisier
    python bench/dpo_vs_trl.py --sharded_only              # only ZeRO-3 / FSDP2 / DDP x2: model state, step time

Ours padded and packed against TRL 1.16 DPOTrainer padded (it has no padding-free DPO), reference log-probs
precomputed on both sides, so a step is one policy forward + backward + AdamW step (bench/README.md has the method).
Sharding: three 2-process runs (ZeRO-3, FSDP2, DDP); per rank, the bytes of parameters, DeepSpeed's fp32 master
copy, gradients and optimizer state where model state peaks: after the last backward of a step, before its update
(harness.state_worker); and the step time of the packed DPO workload under each (each process half the batch, the
same global batch as the one-process runs; wall seconds per step, one compute thread per process on the two cores,
alternating rounds). The TRL worker (`trl-worker`) also serves bench/lora_vs_full.py (`--lora_dropout`).
"""

from __future__ import annotations

import sys

import harness as h

DPO = {**h.HYPER, "beta": 0.1}
ROLES = [("parameters", "param_bytes"), ("DeepSpeed's separate fp32 master copy", "master_bytes"),
         ("gradients", "grad_bytes"), ("optimizer state (AdamW moments)", "optimizer_bytes"),
         ("total", "model_state_bytes")]


def sharded_vs_ddp(args, model_dir: str) -> tuple[dict, list[str], list[str]]:
    """ZeRO-3 x2 and FSDP2 x2 against DDP x2: results, the per-role lines (the rank holding the most) and the summary
    lines."""
    runs = {"zero3": ("zero3.yaml", []), "fsdp2": ("fsdp2.yaml", []), "ddp": ("ddp.yaml", [])}
    sb = h.state_bytes(h.RESULTS / "dpo_vs_trl", model_dir, runs, args.run_timeout_s)
    peak = {n: max(s["ranks"], key=lambda r: r["model_state_bytes"]) for n, s in sb.items()}
    ratio = {n: peak[n]["model_state_bytes"] / peak["ddp"]["model_state_bytes"] for n in ("zero3", "fsdp2")}
    no_master = (peak["zero3"]["model_state_bytes"] - peak["zero3"]["master_bytes"]) / peak["ddp"]["model_state_bytes"]
    notes = [f"{'model state per rank, MiB, after the last backward, before the update':70s}   zero3   fsdp2     ddp"]
    notes += [f"  {label:68s} " + " ".join(f"{peak[n][k] / 2**20:7.2f}" for n in runs) for label, k in ROLES]
    lines = [h.summary_line("zero3_state_bytes_vs_ddp", ratio["zero3"], f"(without DeepSpeed's separate fp32 master "
                            f"copy {no_master:.3f})  target <= 0.55"),
             h.summary_line("fsdp2_state_bytes_vs_ddp", ratio["fsdp2"], "target <= 0.55")]
    return ({"state_bytes": sb, "zero3_state_bytes_vs_ddp": ratio["zero3"],
             "zero3_state_bytes_vs_ddp_without_master": no_master, "fsdp2_state_bytes_vs_ddp": ratio["fsdp2"]},
            notes, lines)


def sharded_step_time(args, s) -> tuple[dict, list[str], list[str]]:
    """The packed DPO workload under ZeRO-3 x2, FSDP2 x2 and DDP x2 in alternating rounds: wall seconds per step."""
    runs = h.alternate({c: lambda tag, c=c: h.run_recipe(s, args, "dpo.py", tag, True, DPO, config=f"{c}.yaml")
                        for c in ("zero3", "fsdp2", "ddp")}, args.rounds)
    figs = {c: h.measured(rs, args.warmup) for c, rs in runs.items()}
    t = {c: f["step_time_s"] for c, f in figs.items()}
    notes = [f"step time x2, packed, {args.batch_size // 2} pairs per process: "
             + ", ".join(f"{c} {t[c]:.3f}s ({figs[c]['tokens_per_s']:.0f} tokens/s)" for c in t)]
    lines = [h.summary_line("fsdp2_step_time_vs_zero3", t["zero3"] / t["fsdp2"], "(ZeRO-3 / FSDP2 s/step; > 1: "
                            "FSDP2 faster)"),
             h.summary_line("fsdp2_step_time_vs_ddp", t["ddp"] / t["fsdp2"], "(DDP / FSDP2 s/step)")]
    return {"sharded_runs": runs, "sharded_step_time_s": t, "fsdp2_step_time_vs_zero3": t["zero3"] / t["fsdp2"],
            "fsdp2_step_time_vs_ddp": t["ddp"] / t["fsdp2"]}, notes, lines


def sharded(args, s) -> tuple[dict, list[str], list[str]]:
    """ZeRO-3, FSDP2 and DDP x2: model state per rank, then step time."""
    (e1, n1, l1), (e2, n2, l2) = sharded_vs_ddp(args, s.model_dir), sharded_step_time(args, s)
    return {**e1, **e2}, n1 + n2, l1 + l2


def main(argv=None):
    p = h.offline_parser(__doc__, 5, 4, "preference pairs per device per step (both sides)")
    p.add_argument("--skip_sharded", action="store_true", help="skip ZeRO-3 / FSDP2 / DDP x2")
    p.add_argument("--sharded_only", action="store_true", help="only ZeRO-3 / FSDP2 / DDP x2")
    args = p.parse_args(argv)
    from verl_kit.data import preference_examples

    s = h.prepare("dpo_vs_trl", args)
    if args.sharded_only:
        extra, notes, more = sharded(args, s)
        print("\n".join(["", *notes, f"results: {h.save_results('dpo_vs_trl_sharded', extra)}", *more]))
        return
    lay = h.layouts(s, args.packing_length, preference_examples, h.preference_sequences)
    runs = h.ours_vs_peer(s, args, "dpo.py", DPO, "dpo_vs_trl.py", lay)
    extra, notes, more = sharded(args, s) if not args.skip_sharded else ({}, [], [])
    h.report(s, args, "DPO vs TRL", "pairs", runs, {"ours_padded": lay["padded"], "ours_packed": lay["packed"]},
             [("dpo_padded_vs_trl", "ours_padded", "trl_padded", "target 1.0 +-5%"),
              ("dpo_packed_vs_trl", "ours_packed", "trl_padded", "target >= 1.5")], argv, extra, notes, more)


def trl_worker(argv):
    """TRL DPOTrainer; with --lora_dropout, given the LoraConfig of harness.LORA with that dropout, and dropout kept
    (TRL's default disable_dropout=True would set it to 0 while ours keeps it)."""
    a = h.trl_args(argv, "--lora_dropout")
    from trl import DPOConfig, DPOTrainer

    lora = {}
    if a.lora_dropout is not None:
        from peft import LoraConfig

        lora["peft_config"] = LoraConfig(r=h.LORA["lora_r"], lora_alpha=h.LORA["lora_alpha"], bias="none",
                                         lora_dropout=float(a.lora_dropout), target_modules="all-linear",
                                         task_type="CAUSAL_LM")
    h.trl_train(a, DPOTrainer, DPOConfig, h.mask_counts, {
        "beta": DPO["beta"], "loss_type": ["sigmoid"], "precompute_ref_log_probs": True,
        "precompute_ref_batch_size": 16, "disable_dropout": not lora}, **lora)


if __name__ == "__main__":
    trl_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-worker"] else main()
