"""LoRA (`--use_peft`) against full fine-tuning, and against TRL's DPOTrainer with the same peft_config.

    python bench/lora_vs_full.py                   # all three comparisons (~10 minutes on 2 CPU cores)
    python bench/lora_vs_full.py --rounds 1 --skip_state_bytes   # quicker, noisier
    python bench/lora_vs_full.py --lora_dropout 0                # no LoRA dropout on either side

Set up like bench/dpo_vs_trl.py (same model, data, batch order and hyper-parameters; its TRL worker given a
LoraConfig). LoRA: harness.LORA on every linear layer of the decoder. Summary lines: `lora_state_bytes_vs_full`
(trainable state per rank under ZeRO-3 x2: fp32 master + gradients + AdamW), `lora_step_vs_full` (>1: LoRA faster),
`dpo_lora_vs_trl` and `dpo_lora_padded_vs_trl` (bench/README.md has the method).
"""

from __future__ import annotations

import harness as h

DPO = {**h.HYPER, "beta": 0.1}
CONFIGS = ("full_packed", "lora_packed", "trl_lora", "lora_padded")  # run order of even rounds, reversed in odd


def main(argv=None):
    p = h.offline_parser(__doc__, 5, 4, "preference pairs per device per step (all sides)")
    p.add_argument("--lora_dropout", type=float, default=h.LORA["lora_dropout"], help="both sides (TRL: 0 by default)")
    p.add_argument("--skip_state_bytes", action="store_true")
    p.set_defaults(run_timeout_s=400)
    args = p.parse_args(argv)
    from verl_kit.data import preference_examples

    s = h.prepare("lora_vs_full", args)
    lay = h.layouts(s, args.packing_length, preference_examples, h.preference_sequences)
    lora = ["--use_peft", *h.flags({**h.LORA, "lora_dropout": args.lora_dropout})]
    ours = lambda c: lambda tag: h.run_recipe(s, args, "dpo.py", tag, c.endswith("packed"), DPO,
                                              lora if "lora" in c else [])
    runs = h.alternate({c: (lambda tag: h.run_peer(s, args, "dpo_vs_trl.py", tag, ["--lora_dropout",
                                                                                   str(args.lora_dropout)]))
                        if c == "trl_lora" else ours(c) for c in CONFIGS}, args.rounds)
    steps = {c: lay["packed" if c.endswith("packed") else "padded"] for c in CONFIGS}
    h.check_same(runs, {c: {"tokens": [x["tokens"] for x in steps[c]]} for c in CONFIGS})
    extra, notes, more = {}, [], []
    if not args.skip_state_bytes:
        sb = h.state_bytes(s.out, s.model_dir, {"full": ("zero3.yaml", []), "lora": ("zero3.yaml", ["--lora"])},
                           args.run_timeout_s)
        peak = lambda name, key: max(r[key] for r in sb[name]["ranks"])
        ratio = peak("lora", "trainable_state_bytes") / peak("full", "trainable_state_bytes")
        total = peak("lora", "model_state_bytes") / peak("full", "model_state_bytes")
        extra = {"state_bytes": sb, "lora_state_bytes_vs_full": ratio, "lora_total_bytes_vs_full": total}
        for name in ("full", "lora"):
            r = {k: v / 2**20 if k.endswith("bytes") else v for k, v in sb[name]["ranks"][0].items()}
            notes.append(f"{name:5s} rank 0: {r['trainable_params'] / 1e6:.3f}M trainable params; trainable state "
                         f"{r['trainable_state_bytes']:.2f} MiB (fp32 master {r['master_bytes']:.2f}, grads "
                         f"{r['grad_bytes']:.2f}, AdamW {r['optimizer_bytes']:.2f}); trained param copies "
                         f"{r['param_bytes']:.2f}, frozen shards {r['frozen_param_bytes']:.2f}; total "
                         f"{r['model_state_bytes']:.2f} MiB")
        more.append(h.summary_line("lora_state_bytes_vs_full", ratio, f"(total per rank incl. frozen base shards "
                                   f"{total:.3f})  target <= 0.05"))
    h.report(s, args, f"LoRA r={h.LORA['lora_r']} (dropout {args.lora_dropout}) vs full, DPO", "pairs", runs,
             {c: steps[c] for c in CONFIGS if c != "trl_lora"},
             [("lora_step_vs_full", "lora_packed", "full_packed", "(>1: LoRA faster)"),
              ("dpo_lora_vs_trl", "lora_packed", "trl_lora", "target >= 1.3"),
              ("dpo_lora_padded_vs_trl", "lora_padded", "trl_lora", "target 1.0 +-5%")], argv, extra, notes, more)


if __name__ == "__main__":
    main()
