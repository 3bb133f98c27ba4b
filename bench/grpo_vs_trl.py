"""GRPO step time: `recipes/grpo.py` against TRL 1.16's GRPOTrainer, measured in the same run.

    python bench/grpo_vs_trl.py                  # both workloads (~5 minutes on 2 CPU cores)
    python bench/grpo_vs_trl.py --steps 2 --skip uniform

The same on both sides: the ~20M-parameter bench Llama, the kind_words reward (verl_kit.rewards.functions), 16 prompts x 4
samples per step, 32 generated tokens with EOS ignored (ours `--ignore_eos`, TRL `min_new_tokens`), a frozen reference
with beta 0.04 (k3 KL in the loss), group advantages scaled by the group std, one optimizer step per rollout (no
old-log-prob pass on either side: TRL num_iterations=1, ours one iteration of one minibatch), the whole batch in one
micro-batch, fp32, one process, one compute thread, gradient checkpointing off. Step time = wall time between the
ends of consecutive steps (ours: metrics.jsonl elapsed_s; TRL: on_step_end), median over the measured steps after
`--warmup`. ratio = TRL / ours. Workloads as in bench/ppo_vs_trl.py: `mixed` prompts (lognormal lengths, median 40
tokens) give the headline `grpo_vs_trl`; `uniform` (the embedded task's 8-11-token prompts) gives
`grpo_vs_trl_uniform`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, save_results  # noqa: E402
from ppo_vs_trl import (  # noqa: E402
    LENGTH,
    _clock,
    _save_ends,
    _worker_args,
    compare_workloads,
    datasets_for,
    run_ours,
    run_trl,
)

PROMPTS, GENERATIONS = 16, 4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--skip", nargs="*", default=[], choices=["mixed", "uniform"])
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    args.model = build_model()
    data = datasets_for(args.model)
    flags = ["--prompts_per_step", str(PROMPTS), "--num_generations", str(GENERATIONS), "--beta", "0.04"]
    results, lines = {"args": vars(args)}, []
    compare_workloads(args, data, results, lines, "grpo_vs_trl", "TRL 1.16 GRPOTrainer",
                      lambda t, path: run_ours(args, t, flags + ["--dataset_name", path], recipe="grpo.py"),
                      lambda t, path: run_trl(args, t, "trl-grpo-worker", ["--data", path],
                                              script=Path(__file__).resolve()))
    save_results("grpo_vs_trl", results)
    for line in lines:
        print(line)


def trl_grpo_worker(argv):
    a = _worker_args(argv, "--data")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_kit.data import load_split
    from verl_kit.rewards import kind_words

    def kind(prompts, completions, **_):  # conversational completions arrive as [{"role", "content"}]
        return kind_words(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions])

    ds = load_split(a.data, "train").select_columns(["prompt"])
    config = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=LENGTH, generation_kwargs={"min_new_tokens": LENGTH},
        gradient_accumulation_steps=1, num_iterations=1, beta=0.04, learning_rate=1e-5, lr_scheduler_type="constant",
        temperature=1.0, top_p=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=42, dataloader_num_workers=0)
    ends = []
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model, dtype="float32"), reward_funcs=kind,
                          args=config, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(a.model),
                          callbacks=[_clock(ends)])
    trainer.train()
    _save_ends(a.out, ends)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-grpo-worker":
        trl_grpo_worker(sys.argv[2:])
    else:
        main()
