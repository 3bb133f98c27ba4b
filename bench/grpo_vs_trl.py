"""GRPO step time: `recipes/grpo.py` against TRL 1.16's GRPOTrainer, measured in the same run.

    python bench/grpo_vs_trl.py                  # both workloads (~5 minutes on 2 CPU cores)
    python bench/grpo_vs_trl.py --steps 2 --skip uniform

The same on both sides: the bench Llama, the kind_words reward (verl_kit.rewards.functions), 16 prompts x 4 samples
per step, 32 generated tokens with EOS ignored (ours `--ignore_eos`, TRL `min_new_tokens`), a frozen reference with
beta 0.04 (k3 KL in the loss), group advantages scaled by the group std, one optimizer step per rollout (no
old-log-prob pass on either side: TRL num_iterations=1, ours one iteration of one minibatch), the whole batch in one
micro-batch, fp32, one process, one compute thread. Workloads (`mixed`: the headline `grpo_vs_trl`; `uniform`:
`grpo_vs_trl_uniform`), step time and ratio (TRL / ours): harness.compare_workloads, as in bench/ppo_vs_trl.py.
"""

from __future__ import annotations

import argparse
import sys

import harness as h

PROMPTS, GENERATIONS = 16, 4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--skip", nargs="*", default=[], choices=["mixed", "uniform"])
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    args.model = h.build_model()
    out = h.RESULTS / "grpo_vs_trl"
    flags = ["--prompts_per_step", str(PROMPTS), "--num_generations", str(GENERATIONS), "--beta", "0.04",
             "--reward_fn", "verl_kit.rewards:kind_words"]  # TRL's side scores with the same function
    results, lines = {"args": vars(args)}, []
    h.compare_workloads(args, h.prompt_sets(args.model), results, lines, "grpo_vs_trl", "TRL 1.16 GRPOTrainer",
                        lambda t, path: h.run_online(args, out, t, "grpo.py", flags + ["--dataset_name", path]),
                        lambda t, path: h.run_online_peer(args, out, t, "grpo_vs_trl.py", "trl-grpo-worker",
                                                          ["--data", path]))
    h.save_results("grpo_vs_trl", results)
    print("\n".join(lines))


def trl_grpo_worker(argv):
    a = h.trl_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_kit.data import load_split
    from verl_kit.rewards import kind_words

    def kind(prompts, completions, **_):  # conversational completions arrive as [{"role", "content"}]
        return kind_words(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions])

    ds = load_split(a.data, "train").select_columns(["prompt"])
    config = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=h.LENGTH, generation_kwargs={"min_new_tokens": h.LENGTH},
        gradient_accumulation_steps=1, num_iterations=1, beta=0.04, learning_rate=1e-5, lr_scheduler_type="constant",
        temperature=1.0, top_p=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=42, dataloader_num_workers=0)
    clock = h.step_clock()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model, dtype="float32"), reward_funcs=kind,
                          args=config, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(a.model),
                          callbacks=[clock])
    trainer.train()
    clock.save(f"{a.out}/steps.json")


if __name__ == "__main__":
    trl_grpo_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-grpo-worker"] else main()
