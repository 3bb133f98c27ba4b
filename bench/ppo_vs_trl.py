"""PPO step time: `recipes/ppo.py` against TRL's GRPOTrainer, measured in the same run.

    python bench/ppo_vs_trl.py                  # the whole comparison (a few minutes on 2 CPU cores)
    python bench/ppo_vs_trl.py --rounds 1 --steps 3

TRL 1.16 has no PPOTrainer (it left with 0.x's experimental trainers), so the peer is its closest on-policy RL
trainer, GRPOTrainer. Both sides: the same ~20M-parameter Llama (bench/common.py), the embedded task's prompts and
reward (verl_kit.rewards:kind_words), the same batch (`--prompts` prompts x `--generations` samples), a fixed
generation length (EOS ignored: ours `--ignore_eos`, TRL `generation_kwargs={"min_new_tokens": L}`), a frozen
reference model scored every step (TRL beta=0.04), one optimizer step per batch (ours one PPO epoch of one
minibatch; TRL num_iterations=1, steps_per_generation=1), fp32, one process each, gradient checkpointing off.
PPO also trains a critic (a values forward, then a critic forward, backward and AdamW step) that GRPO does not have,
so ours does more work per step. Runs alternate (ours, TRL, then the reverse); each run skips `--warmup` steps; the
figure is the median step wall time over the measured steps (ours: timing_s/step from metrics.jsonl; TRL: time
between consecutive on_step_end callbacks). ratio = TRL step time / ours. The generation share is ours
timing_s/gen / timing_s/step; TRL generates inside its training step and reports no split. Also printed, for a
like-for-like reading: ours without the critic's work (timing_s/values + timing_s/update_critic subtracted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PYTHON, RESULTS, ROOT, build_model, count_parameters, median, run, save_results, summary_line  # noqa: E402

OUT = RESULTS / "ppo_vs_trl"


def run_ours(args, model_dir: str, tag: str) -> dict:
    out = OUT / tag
    cmd = [PYTHON, str(ROOT / "recipes" / "ppo.py"), "--model_name_or_path", model_dir, "--output_dir", str(out),
           "--max_steps", str(args.warmup + args.steps), "--prompts_per_step", str(args.prompts),
           "--num_generations", str(args.generations), "--max_completion_length", str(args.length),
           "--ignore_eos", "true", "--num_ppo_epochs", "1", "--num_mini_batches", "1",
           "--per_device_train_batch_size", str(args.prompts * args.generations), "--gradient_checkpointing", "false",
           "--learning_rate", "1e-5", "--critic_learning_rate", "1e-5", "--logging_steps", "1",
           "--lr_scheduler_type", "constant", "--kl_coef", "0.04", "--dataset_test_split", "none"]
    run(cmd, OUT / f"{tag}.log", args.timeout, prefix=f"[{tag}] ")
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()][args.warmup:]
    critic = [r["timing_s/values"] + r["timing_s/update_critic"] for r in rows]
    return {"step_s": [r["timing_s/step"] for r in rows], "gen_s": [r["timing_s/gen"] for r in rows],
            "critic_s": critic, "response_length": [r["response_length/mean"] for r in rows]}


def run_trl(args, model_dir: str, tag: str) -> dict:
    out = OUT / tag
    cmd = [PYTHON, str(Path(__file__).resolve()), "trl-worker", "--model", model_dir, "--out", str(out),
           "--steps", str(args.warmup + args.steps), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--length", str(args.length)]
    run(cmd, OUT / f"{tag}.log", args.timeout, prefix=f"[{tag}] ")
    with open(out / "steps.json") as f:
        ends = json.load(f)["step_end_times"]
    steps = [b - a for a, b in zip(ends, ends[1:])]  # step k's time: end of k-1 -> end of k (k >= 1)
    return {"step_s": steps[max(args.warmup - 1, 0):]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1, help="alternating pairs of runs (ours+TRL, then TRL+ours)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt")
    p.add_argument("--length", type=int, default=32, help="generated tokens per sample (EOS ignored)")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    model_dir = build_model()
    print(f"model: {count_parameters(model_dir) / 1e6:.1f}M parameters; batch {args.prompts} prompts x "
          f"{args.generations} samples x {args.length} new tokens", flush=True)
    ours, trl = [], []
    for r in range(args.rounds):
        order = [("ours", run_ours), ("trl", run_trl)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            (ours if name == "ours" else trl).append(fn(args, model_dir, f"{name}-{r}"))
    ours_step = median([s for x in ours for s in x["step_s"]])
    ours_gen = median([g / s for x in ours for g, s in zip(x["gen_s"], x["step_s"])])
    ours_no_critic = median([s - c for x in ours for s, c in zip(x["step_s"], x["critic_s"])])
    trl_step = median([s for x in trl for s in x["step_s"]])
    assert all(length == args.length for x in ours for length in x["response_length"]), "EOS was not ignored"
    results = {"ours": ours, "trl": trl, "ours_step_s": ours_step, "trl_step_s": trl_step,
               "ours_generation_share": ours_gen,
               "ours_step_without_critic_s": ours_no_critic, "ratio": trl_step / ours_step, "args": vars(args)}
    save_results("ppo_vs_trl", results)
    print(f"ours  step {ours_step:.2f}s (generation {100 * ours_gen:.0f}% of the step)")
    print(f"ours  step without the critic's work (values pass, critic update): {ours_no_critic:.2f}s")
    print(f"TRL GRPOTrainer step {trl_step:.2f}s (generation share not reported by TRL)")
    print(summary_line("ppo_vs_trl", trl_step / ours_step,
                       f"ours {ours_step:.2f}s/step vs TRL GRPO {trl_step:.2f}s/step, ours gen share {ours_gen:.2f}"))


def trl_worker(argv):
    p = argparse.ArgumentParser()
    for name in ("--model", "--out"):
        p.add_argument(name, required=True)
    for name in ("--steps", "--prompts", "--generations", "--length"):
        p.add_argument(name, type=int, required=True)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_kit.data import load_split
    from verl_kit.rewards import kind_words
    from verl_kit.tiny import TINY_PREFS

    def kind(prompts, completions, **_):  # conversational completions arrive as [{"role", "content"}]
        return kind_words(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions])

    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.time())

    ds = load_split(TINY_PREFS, "train").select_columns(["prompt"])
    config = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.prompts * a.generations,
        num_generations=a.generations, max_completion_length=a.length,
        generation_kwargs={"min_new_tokens": a.length}, gradient_accumulation_steps=1, num_iterations=1,
        beta=0.04, learning_rate=1e-5, lr_scheduler_type="constant", temperature=1.0, top_p=1.0, use_cpu=True,
        bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=42, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(model=model, reward_funcs=kind, args=config, train_dataset=ds, processing_class=tokenizer,
                          callbacks=[Clock()])
    trainer.train()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "steps.json", "w") as f:
        json.dump({"step_end_times": ends}, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        trl_worker(sys.argv[2:])
    else:
        main()
