"""KTO throughput: `recipes/kto.py` against TRL's KTOTrainer, measured in the same run.

    python bench/kto_vs_trl.py                  # the whole comparison (a few minutes on 2 CPU cores)
    python bench/kto_vs_trl.py --rounds 1       # quicker, noisier

Each synthetic preference row becomes a desirable (chosen) and an undesirable (rejected) example; the KL sequences
differ in pairing only, so the target tokens per step are checked to agree (bench/README.md has the method).
"""

from __future__ import annotations

import sys

import harness as h

KTO = {**h.HYPER, "beta": 0.1}


def unpaired(row: dict) -> list[dict]:
    """Paired row i -> unpaired rows 2i (chosen, desirable) and 2i+1 (rejected, undesirable)."""
    return [{"prompt": row["prompt"], "completion": row[key], "label": label}
            for key, label in (("chosen", True), ("rejected", False))]


def main(argv=None):
    args = h.offline_parser(__doc__, 3, 4, "unpaired examples per device per step (both sides)").parse_args(argv)
    from verl_kit.data import load_split, unpaired_examples
    from verl_kit.models import load_tokenizer

    s = h.prepare("kto_vs_trl", args, unpaired, per_row=2)
    runs = h.ours_vs_peer(s, args, "kto.py", KTO, "kto_vs_trl.py")
    exs = unpaired_examples(load_split(str(s.data), "train"), load_tokenizer(s.model_dir), 256,
                            h.HYPER["max_length"], str(s.data))
    target = [sum(len(exs[i].prompt_ids) + len(exs[i].completion_ids) for i in idx) for idx in s.order]
    h.check_same(runs, {"trl_padded": {"target_tokens": target}})
    h.report(s, args, "KTO vs TRL", "examples", runs, {},
             [("kto_padded_vs_trl", "ours_padded", "trl_padded", "padding on both sides"),
              ("kto_vs_trl", "ours_packed", "trl_padded", "ours packed vs TRL padded; target >= 1.5")], argv)


def trl_worker(argv):
    a = h.trl_args(argv)
    from trl import KTOConfig, KTOTrainer

    def count(inputs):
        target, kl = int(inputs["attention_mask"].sum()), int(inputs["KL_attention_mask"].sum())
        return {"tokens": target + kl, "target_tokens": target, "kl_tokens": kl}

    h.trl_train(a, KTOTrainer, KTOConfig, count, {"beta": KTO["beta"], "desirable_weight": 1.0,
                                                  "undesirable_weight": 1.0, "precompute_ref_log_probs": True})


if __name__ == "__main__":
    trl_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-worker"] else main()
