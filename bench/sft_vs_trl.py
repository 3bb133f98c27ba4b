"""SFT throughput: `recipes/sft.py` against TRL's SFTTrainer, measured in the same run.

    python bench/sft_vs_trl.py                  # the whole comparison (about 10 minutes on 2 CPU cores)
    python bench/sft_vs_trl.py --rounds 1       # quicker, noisier

Rows: the synthetic preference rows' prompt + chosen, completion-only loss. TRL runs `padded`, `padding_free` (the
same rows per step as ours, real and learned tokens checked) and `bfd` (the dataset packed into rows of 1024 tokens,
`--trl_packed_rows` per step). `sft_vs_trl`: ours packed against the faster of TRL padding_free and bfd;
`sft_padded_vs_trl`: padded against padded (bench/README.md has the method).
"""

from __future__ import annotations

import sys

import harness as h

TRL_MODES = ("padded", "padding_free", "bfd")


def main(argv=None):
    p = h.offline_parser(__doc__, 3, 8, "sequences per device per step (ours, TRL unpacked)")
    p.add_argument("--trl_packed_rows", type=int, default=2, help="TRL bfd: packed rows per device per step")
    args = p.parse_args(argv)
    from verl_kit.data import sft_examples

    s = h.prepare("sft_vs_trl", args, lambda r: [{"prompt": r["prompt"], "completion": r["chosen"]}])
    (bfd := s.out / "data" / "trl_bfd.jsonl").write_text(s.peer_data.read_text() * 2)  # bfd: fewer, fuller rows
    lay = h.layouts(s, args.packing_length, sft_examples, lambda e: ([e.input_ids], [e.loss_mask]))
    ours = lambda packing: lambda tag: h.run_recipe(s, args, "sft.py", tag, packing, h.HYPER)
    trl = lambda m: lambda tag: h.run_peer(s, args, "sft_vs_trl.py", tag, ["--mode", m], bfd if m == "bfd" else None,
                                           args.trl_packed_rows if m == "bfd" else None)
    runs = h.alternate({"ours_padded": ours(False), **{f"trl_{m}": trl(m) for m in TRL_MODES},
                        "ours_packed": ours(True)}, args.rounds)
    same = {k: [x[k] for x in lay["padded"]] for k in ("tokens", "learned")}
    h.check_same(runs, {"trl_padded": same, "trl_padding_free": same})
    best = max(("padding_free", "bfd"), key=lambda m: h.measured(runs[f"trl_{m}"], args.warmup)["tokens_per_cpu_s"])
    row_length = {m: max(runs[f"trl_{m}"][0]["row_length"]) for m in TRL_MODES}
    h.report(s, args, "SFT vs TRL", "sequences", runs, {"ours_padded": lay["padded"], "ours_packed": lay["packed"]},
             [("sft_padded_vs_trl", "ours_padded", "trl_padded", "padded vs TRL padded; target 1.0 +-5%"),
              ("sft_vs_trl", "ours_packed", f"trl_{best}", f"ours packed vs TRL {best} (its faster padding-free mode); "
               "target >= 1.2")], argv, {"trl_row_length": row_length},
             [f"TRL row lengths: {row_length}"])


def trl_worker(argv):
    a = h.trl_args(argv, "--mode")
    from trl import SFTConfig, SFTTrainer

    def count(inputs):  # padding-free: every position is real
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        return {"tokens": int(mask.sum()) if mask is not None else ids.numel(),
                "learned": int((inputs["labels"] != -100).sum()), "slots": ids.numel(), "row_length": ids.shape[1]}

    # bfd: the packed row length. Padding-free without packing refuses a max_length (it would not be enforced); no row
    # here exceeds 1024 tokens.
    h.trl_train(a, SFTTrainer, SFTConfig, count, {
        "packing": a.mode == "bfd", "packing_strategy": "bfd", "padding_free": a.mode == "padding_free",
        "max_length": None if a.mode == "padding_free" else h.HYPER["max_length"], "completion_only_loss": True})


if __name__ == "__main__":
    trl_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-worker"] else main()
