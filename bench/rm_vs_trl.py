"""Reward-model throughput: `recipes/reward_model.py` against TRL's RewardTrainer, measured in the same run.

    python bench/rm_vs_trl.py                   # the whole comparison (5-10 minutes on 2 shared CPU cores)
    python bench/rm_vs_trl.py --rounds 1        # quicker, noisier

The bench Llama with a fresh one-label `score` head, Bradley-Terry loss. TRL 1.16's RewardTrainer has no packing and
no padding-free path, so TRL runs padded in both comparisons (bench/README.md has the method).
"""

from __future__ import annotations

import sys

import harness as h


def main(argv=None):
    args = h.offline_parser(__doc__, 4, 4, "preference pairs per device per step (both sides)").parse_args(argv)
    from verl_kit.data import preference_examples

    s = h.prepare("rm_vs_trl", args)
    lay = h.layouts(s, args.packing_length, preference_examples, h.preference_sequences)
    runs = h.ours_vs_peer(s, args, "reward_model.py", h.HYPER, "rm_vs_trl.py", lay)
    h.report(s, args, "Reward model vs TRL", "pairs", runs,
             {"ours_padded": lay["padded"], "ours_packed": lay["packed"]},
             [("rm_padded_vs_trl", "ours_padded", "trl_padded", "padded vs TRL padded; target 1.0 +-5%"),
              ("rm_vs_trl", "ours_packed", "trl_padded", "ours packed vs TRL padded (no packed mode); target >= 1.3")],
             argv)


def trl_worker(argv):
    a = h.trl_args(argv)
    import torch
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    h.trl_train(a, RewardTrainer, RewardConfig, h.mask_counts, {}, model=model)


if __name__ == "__main__":
    trl_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-worker"] else main()
