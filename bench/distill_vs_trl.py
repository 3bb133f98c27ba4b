"""On-policy distillation step time: `recipes/distill.py` against TRL 1.16's DistillationTrainer, in the same run.

    python bench/distill_vs_trl.py                  # both workloads (~10 minutes on 2 CPU cores)
    python bench/distill_vs_trl.py --steps 2 --skip uniform

The same on both sides: the bench Llama as the student, and as the teacher the same architecture and tokenizer with
other weights (harness.build_model with seed 1, the student has seed 0), 64 prompts x 1 sample per step, 32 generated
tokens with EOS ignored (ours `--ignore_eos`, TRL `min_new_tokens`; both sides check every response has 32 tokens),
HF generate (sampling at temperature 1, no top-p / top-k) on both sides, one optimizer step per rollout (ours one
iteration of one minibatch), the whole batch in one micro-batch, AdamW at a constant 1e-5 with clipping at 1.0, no
gradient checkpointing, fp32, one process, one compute thread.

The loss is the same maths on both sides: the generalized JSD over the whole vocabulary at every sampled position,
mixture m = (1 - beta) p_student + beta q_teacher, token mean (ours `--loss_type jsd --beta B`,
verl_kit.algos.generalized_jsd; TRL `beta=B`, its chunked divergence kernel), beta 0.5 by default (`--beta`; 1 is
the reverse KL over the whole vocabulary, TRL's default). TRL 1.16's DistillationTrainer has no sampled-token path:
ours' default `--loss_type reverse_kl` (one teacher log-prob per sampled token, advantage -(log p - log q) through
the clipped policy loss) has no TRL counterpart, so it is not compared. Fully on-policy is all the stable trainer
does: every step the student generates the completions (no `lmbda`: mixing in dataset completions is the
experimental GKDTrainer's, not compared), one completion per prompt (no `num_generations`), hence ours
`--num_generations 1`. No task reward on either side (ours `--reward_fn none`). Workloads (`mixed`: the headline
`distill_vs_trl`; `uniform`: `distill_vs_trl_uniform`), step time and ratio (TRL / ours): harness.compare_workloads,
as in bench/grpo_vs_trl.py.
"""

from __future__ import annotations

import argparse
import sys

import harness as h

PROMPTS = 64  # x 1 sample: TRL's DistillationTrainer samples one completion per prompt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--beta", type=float, default=0.5, help="generalized JSD coefficient, both sides (1: reverse KL)")
    p.add_argument("--skip", nargs="*", default=[], choices=["mixed", "uniform"])
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    args.model = h.build_model()
    teacher = h.build_model(h.RESULTS / "cache" / "tiny-llama-20m-seed1", seed=1)
    out = h.RESULTS / "distill_vs_trl"
    print(f"student and teacher: {h.count_parameters(args.model) / 1e6:.1f}M parameters each (seeds 0 and 1); "
          f"{PROMPTS} prompts x 1 sample x {h.LENGTH} new tokens per step, generalized JSD beta {args.beta}",
          flush=True)
    flags = ["--teacher_model_name_or_path", teacher, "--loss_type", "jsd", "--beta", str(args.beta),
             "--prompts_per_step", str(PROMPTS), "--num_generations", "1", "--reward_fn", "none"]
    results, lines = {"args": vars(args), "teacher": teacher}, []
    h.compare_workloads(args, h.prompt_sets(args.model), results, lines, "distill_vs_trl",
                        "TRL 1.16 DistillationTrainer",
                        lambda t, path: h.run_online(args, out, t, "distill.py", flags + ["--dataset_name", path]),
                        lambda t, path: h.run_online_peer(args, out, t, "distill_vs_trl.py", "trl-distill-worker",
                                                          ["--data", path, "--teacher", teacher,
                                                           "--beta", str(args.beta)]))
    h.save_results("distill_vs_trl", results)
    print("\n".join(lines))


def trl_distill_worker(argv):
    a = h.trl_args(argv, "--teacher", "--beta")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from verl_kit.data import load_split

    class Lengths(TrainerCallback):  # TRL logs the completion lengths of every step (logging_steps=1)
        seen = []

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "completions/min_length" in logs:
                self.seen.append((logs["completions/min_length"], logs["completions/max_length"]))

    ds = load_split(a.data, "train").select_columns(["prompt"])
    config = DistillationConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=PROMPTS, gradient_accumulation_steps=1,
        max_completion_length=h.LENGTH, generation_kwargs={"min_new_tokens": h.LENGTH}, beta=float(a.beta),
        learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
        use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=42, dataloader_num_workers=0)
    clock, lengths = h.step_clock(), Lengths()
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = DistillationTrainer(model=load(a.model), teacher_model=load(a.teacher), args=config, train_dataset=ds,
                                  processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[clock, lengths])
    trainer.train()
    assert lengths.seen and all(lo == hi == h.LENGTH for lo, hi in lengths.seen), f"EOS was not ignored: {lengths.seen}"
    clock.save(f"{a.out}/steps.json")


if __name__ == "__main__":
    trl_distill_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-distill-worker"] else main()
