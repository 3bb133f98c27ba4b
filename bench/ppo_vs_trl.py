"""PPO step time: `recipes/ppo.py` against TRL 1.12's PPOTrainer (the last TRL with one), and the recipe's defaults
against the pinned TRL 1.16's GRPOTrainer, measured in the same run.

    make bench-deps && python bench/ppo_vs_trl.py        # the whole comparison (~8 minutes on 2 CPU cores)
    python bench/ppo_vs_trl.py --steps 2 --skip grpo

The peer: TRL 1.12 installed with --no-deps beside the venv (`make bench-deps`: .venv/side/trl-1.12), first on its
worker's PYTHONPATH, so it runs on the same torch, transformers and accelerate as ours. Both sides run the same PPO
and passes per step: sampling log-probs as the old log-probs (ours `--old_logprobs rollout`), a frozen reference, a
reward model that also initialises the value model (ours `--critic_init reward`), 64 prompts x 1 sample, one PPO
epoch of one minibatch. Workloads (`mixed`: the headline `ppo_vs_trl`; `uniform`), step time and ratio (TRL / ours):
harness.compare_workloads. `ppo_vs_trl_grpo` is not like for like (GRPO has no critic); bench/README.md has the method.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import harness as h

OUT = h.RESULTS / "ppo_vs_trl"
TRL_PPO_DIR = h.ROOT / ".venv" / "side" / "trl-1.12"
BATCH = 64


def build_reward_model(model_dir: str) -> str:
    """The bench Llama with a sequence-classification head (seeded): reward model and value-model init."""
    out = Path(model_dir + "-rm")
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.manual_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        rm.config.pad_token_id = tokenizer.pad_token_id
        rm.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--skip", nargs="*", default=[], choices=["mixed", "uniform", "grpo"])
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if not (TRL_PPO_DIR / "trl" / "experimental" / "ppo").is_dir():
        sys.exit(f"TRL 1.12 (the PPOTrainer peer) is not installed in {TRL_PPO_DIR}: run `make bench-deps`")
    args.model = h.build_model()
    args.rm = build_reward_model(args.model)
    data = h.prompt_sets(args.model)
    print(f"model: {h.count_parameters(args.model) / 1e6:.1f}M parameters; {BATCH} prompts x 1 sample x {h.LENGTH} "
          f"new tokens per step", flush=True)
    side_env = {**h.bench_env(), "PYTHONPATH": os.pathsep.join([str(TRL_PPO_DIR), str(h.ROOT)]),
                "TRL_EXPERIMENTAL_SILENCE": "1"}
    ppo_flags = ["--prompts_per_step", str(BATCH), "--num_generations", "1", "--reward_fn", "none",
                 "--reward_model_name_or_path", args.rm, "--critic_init", "reward", "--old_logprobs", "rollout",
                 "--kl_coef", "0.05", "--critic_learning_rate", "1e-5"]
    results, lines = {"args": vars(args)}, []
    h.compare_workloads(
        args, data, results, lines, "ppo_vs_trl", "TRL 1.12 PPOTrainer",
        lambda t, path: h.run_online(args, OUT, t, "ppo.py", ppo_flags + ["--dataset_name", path]),
        lambda t, path: h.run_online_peer(args, OUT, t, "ppo_vs_trl.py", "trl-ppo-worker",
                                          ["--rm", args.rm, "--data", path], side_env))
    if "grpo" not in args.skip:
        defaults = ["--prompts_per_step", "16", "--num_generations", "4", "--kl_coef", "0.04",
                    "--critic_learning_rate", "1e-5"]
        ours = h.run_online(args, OUT, "ppo-defaults-ours", "ppo.py", defaults)
        trl = h.run_online_peer(args, OUT, "grpo-trl-embedded", "grpo_vs_trl.py", "trl-grpo-worker",
                                ["--data", data["uniform"]])
        o, t = h.median(ours["step_s"]), h.median(trl["step_s"])
        results["grpo"] = {"ours": ours, "trl": trl, "ours_step_s": o, "trl_step_s": t, "ratio": t / o}
        lines.append(h.summary_line("ppo_vs_trl_grpo", t / o, f"embedded task, ours PPO defaults {o:.2f}s/step vs "
                                    f"TRL 1.16 GRPOTrainer {t:.2f}s/step (GRPO has no critic: not like for like)"))
    h.save_results("ppo_vs_trl", results)
    print("\n".join(lines))


def trl_ppo_worker(argv):
    a = h.trl_args(argv, "--rm")
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from verl_kit.data import load_split

    assert trl.__version__ == "1.12.0", f"expected the side-installed TRL 1.12.0, got {trl.__version__}"
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.padding_side = "left"
    ds = load_split(a.data, "train")
    ds = ds.map(lambda r: {"input_ids": tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False)},
                remove_columns=ds.column_names)
    config = PPOConfig(
        output_dir=a.out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_mini_batches=1,
        num_ppo_epochs=1, total_episodes=BATCH * a.steps, local_rollout_forward_batch_size=BATCH,
        response_length=h.LENGTH, stop_token=None, temperature=1.0, kl_coef=0.05, learning_rate=1e-5,
        lr_scheduler_type="constant", use_cpu=True, bf16=False, gradient_checkpointing=False,
        num_sample_generations=0, save_strategy="no", report_to="none", logging_steps=1, seed=42,
        dataloader_num_workers=0, disable_tqdm=True)
    load = lambda cls, path: cls.from_pretrained(path, dtype=torch.float32, **(
        {"num_labels": 1} if cls is AutoModelForSequenceClassification else {}))
    clock = h.step_clock()
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=load(AutoModelForCausalLM, a.model),
                         ref_model=load(AutoModelForCausalLM, a.model),
                         reward_model=load(AutoModelForSequenceClassification, a.rm),
                         value_model=load(AutoModelForSequenceClassification, a.rm), train_dataset=ds,
                         callbacks=[clock])
    trainer.train()
    clock.save(f"{a.out}/steps.json")


if __name__ == "__main__":
    trl_ppo_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-ppo-worker"] else main()
