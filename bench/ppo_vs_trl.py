"""PPO step time: `recipes/ppo.py` against TRL's PPOTrainer (TRL 1.12, the last release with one) and against the
pinned TRL's GRPOTrainer, measured in the same run.

    make bench-deps && python bench/ppo_vs_trl.py        # the whole comparison (~8 minutes on 2 CPU cores)
    python bench/ppo_vs_trl.py --steps 2 --skip grpo

The peer. TRL 1.16 has no PPOTrainer; TRL 1.12 has it as trl.experimental.ppo. It is installed with --no-deps into
a side directory (`make bench-deps`: .venv/side/trl-1.12) that goes first on the worker's PYTHONPATH, so it runs on
the same torch/transformers/accelerate as ours. Its algorithm is the same PPO as ours: sampling log-probs as the old
log-probs, a frozen reference, a reward model, a value model, GAE, whitened advantages, clipped policy and value
losses. So ours runs with `--old_logprobs rollout` here, and both sides do the same passes per step: generation, a
reference forward, a value forward, a reward-model forward, then a policy and a value forward+backward and an AdamW
step each (TRL: one optimizer over the policy+value wrapper).

The same on both sides: the ~20M-parameter Llama (bench/common.py) as policy and reference; a reward model built from
it (LlamaForSequenceClassification, seeded score head) that also initialises the value model (ours
`--critic_init reward`); 64 prompts x 1 sample per step; 32 generated tokens, EOS ignored (ours `--ignore_eos`, TRL
`stop_token=None`); one PPO epoch of one minibatch of one micro-batch; fp32, one process, gradient checkpointing off.
Step time = wall time between the ends of consecutive steps (ours: metrics.jsonl elapsed_s; TRL: on_step_end), median
over the measured steps after `--warmup`. ratio = TRL / ours. Runs alternate order between workloads.

Workloads: `mixed` prompts have lognormal lengths (median 40 tokens, sigma 0.6, up to 200: bench/common.py
write_preference_data), as real prompt sets do; `uniform` are the embedded task's prompts (8-11 tokens), where there
is no padding to save, so the two should be close. The headline `ppo_vs_trl` is `mixed`.

Also printed: `ppo_vs_trl_grpo`, ours (defaults: log-probs recomputed, kind_words reward, critic from the policy)
against TRL 1.16 GRPOTrainer (beta 0.04, no critic; bench/grpo_vs_trl.py's worker) on the embedded task. GRPO does
less work per step (no value model, no critic update), so this is not like for like; the like-for-like GRPO
comparison is bench/grpo_vs_trl.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PYTHON,
    RESULTS,
    ROOT,
    bench_env,
    build_model,
    count_parameters,
    median,
    run,
    save_results,
    summary_line,
    write_preference_data,
)

OUT = RESULTS / "ppo_vs_trl"
TRL_PPO_DIR = ROOT / ".venv" / "side" / "trl-1.12"
BATCH, LENGTH = 64, 32


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


def datasets_for(model_dir: str) -> dict[str, str]:
    from transformers import AutoTokenizer

    from verl_kit.models import TINY_PREFS

    mixed = OUT / "data" / "mixed_prompts.jsonl"
    if not mixed.is_file():
        write_preference_data(mixed, AutoTokenizer.from_pretrained(model_dir), n=2000, seed=0, prompt_median=40)
    return {"mixed": str(mixed), "uniform": TINY_PREFS}


def step_times(ends: list[float], warmup: int) -> list[float]:
    """Step k's time is end(k) - end(k-1), k >= 1; the first `warmup` steps are dropped."""
    return [b - a for a, b in zip(ends, ends[1:])][max(warmup - 1, 0):]


def run_ours(args, tag: str, extra: list[str], recipe: str = "ppo.py") -> dict:
    out = OUT / tag
    one_update = ["--num_ppo_epochs", "1"] if recipe == "ppo.py" else ["--num_iterations", "1"]
    cmd = [PYTHON, str(ROOT / "recipes" / recipe), "--model_name_or_path", args.model, "--output_dir", str(out),
           "--max_steps", str(args.warmup + args.steps), "--max_completion_length", str(LENGTH),
           "--ignore_eos", "true", *one_update, "--num_mini_batches", "1",
           "--per_device_train_batch_size", str(BATCH),
           "--gradient_checkpointing", "false", "--learning_rate", "1e-5", "--logging_steps", "1",
           "--lr_scheduler_type", "constant", "--dataset_test_split", "none", *extra]
    run(cmd, OUT / f"{tag}.log", args.timeout, prefix=f"[{tag}] ")
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert all(r["response_length/mean"] == LENGTH for r in rows), "EOS was not ignored"
    measured = rows[args.warmup:]
    return {"step_s": step_times([r["elapsed_s"] for r in rows], args.warmup),
            "gen_s": [r["timing_s/gen"] for r in measured], "inner_step_s": [r["timing_s/step"] for r in measured],
            "timing": {k: median([r[k] for r in measured]) for k in measured[0] if k.startswith("timing_s/")}}


def run_trl(args, tag: str, worker: str, extra: list[str], env: dict | None = None,
            script: Path = Path(__file__).resolve()) -> dict:
    out = OUT / tag
    cmd = [PYTHON, str(script), worker, "--model", args.model, "--out", str(out),
           "--steps", str(args.warmup + args.steps), *extra]
    run(cmd, OUT / f"{tag}.log", args.timeout, env=env, prefix=f"[{tag}] ")
    with open(out / "steps.json") as f:
        ends = json.load(f)["step_end_times"]
    return {"step_s": step_times(ends, args.warmup)}


def compare_workloads(args, data: dict, results: dict, lines: list, key: str, peer: str, ours_fn, trl_fn) -> None:
    """For each workload not in args.skip (mixed, then uniform; the order of ours and TRL alternates): run both,
    store the figures in results[workload] and append the summary line (`key` for mixed, `key`_uniform)."""
    for n, workload in enumerate(w for w in ("mixed", "uniform") if w not in args.skip):
        jobs = [("ours", ours_fn), ("trl", trl_fn)]
        got = {name: fn(f"{key}-{workload}-{name}", data[workload])
               for name, fn in (jobs if n % 2 == 0 else jobs[::-1])}
        ours, trl = median(got["ours"]["step_s"]), median(got["trl"]["step_s"])
        gen = median([g / s for g, s in zip(got["ours"]["gen_s"], got["ours"]["inner_step_s"])])
        results[workload] = {**got, "ours_step_s": ours, "trl_step_s": trl, "ours_generation_share": gen,
                             "ratio": trl / ours}
        print(f"{workload}: ours {ours:.2f}s/step (generation {100 * gen:.0f}%; "
              + ", ".join(f"{k[9:]} {v:.2f}" for k, v in got["ours"]["timing"].items()) + f"), {peer} "
              f"{trl:.2f}s/step", flush=True)
        lines.append(summary_line(key if workload == "mixed" else f"{key}_uniform", trl / ours,
                                  f"{workload} prompts: ours {ours:.2f}s/step vs {peer} {trl:.2f}s/step, "
                                  f"ours gen share {gen:.2f}"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--skip", nargs="*", default=[], choices=["mixed", "uniform", "grpo"])
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if not (TRL_PPO_DIR / "trl" / "experimental" / "ppo").is_dir():
        sys.exit(f"TRL 1.12 (the PPOTrainer peer) is not installed in {TRL_PPO_DIR}: run `make bench-deps`")
    args.model = build_model()
    args.rm = build_reward_model(args.model)
    data = datasets_for(args.model)
    print(f"model: {count_parameters(args.model) / 1e6:.1f}M parameters; {BATCH} prompts x 1 sample x {LENGTH} "
          f"new tokens per step", flush=True)
    side_env = {**bench_env(), "PYTHONPATH": os.pathsep.join([str(TRL_PPO_DIR), str(ROOT)]),
                "TRL_EXPERIMENTAL_SILENCE": "1"}
    ppo_flags = ["--prompts_per_step", str(BATCH), "--num_generations", "1", "--reward_fn", "none",
                 "--reward_model_name_or_path", args.rm, "--critic_init", "reward", "--old_logprobs", "rollout",
                 "--kl_coef", "0.05", "--critic_learning_rate", "1e-5"]
    results, lines = {"args": vars(args)}, []
    compare_workloads(
        args, data, results, lines, "ppo_vs_trl", "TRL 1.12 PPOTrainer",
        lambda t, path: run_ours(args, t, ppo_flags + ["--dataset_name", path]),
        lambda t, path: run_trl(args, t, "trl-ppo-worker", ["--rm", args.rm, "--data", path], side_env))
    if "grpo" not in args.skip:
        ours = run_ours(args, "ppo-defaults-ours", ["--prompts_per_step", "16", "--num_generations", "4",
                                                    "--kl_coef", "0.04", "--critic_learning_rate", "1e-5"])
        trl = run_trl(args, "grpo-trl-embedded", "trl-grpo-worker", ["--data", data["uniform"]],
                      script=ROOT / "bench" / "grpo_vs_trl.py")
        o, t = median(ours["step_s"]), median(trl["step_s"])
        results["grpo"] = {"ours": ours, "trl": trl, "ours_step_s": o, "trl_step_s": t, "ratio": t / o}
        lines.append(summary_line("ppo_vs_trl_grpo", t / o, f"embedded task, ours PPO defaults {o:.2f}s/step vs TRL "
                                  f"1.16 GRPOTrainer {t:.2f}s/step (GRPO has no critic: not like for like)"))
    save_results("ppo_vs_trl", results)
    for line in lines:
        print(line)


# ---- TRL workers (each runs in its own process) ------------------------------------------------------------------


def _worker_args(argv, *extra: str):
    p = argparse.ArgumentParser()
    for name in ("--model", "--out", *extra):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, required=True)
    return p.parse_args(argv)


def _clock(ends: list[float]):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.time())

    return Clock()


def _save_ends(out: str, ends: list[float]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "steps.json", "w") as f:
        json.dump({"step_end_times": ends}, f)


def trl_ppo_worker(argv):
    a = _worker_args(argv, "--rm", "--data")
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
        response_length=LENGTH, stop_token=None, temperature=1.0, kl_coef=0.05, learning_rate=1e-5,
        lr_scheduler_type="constant", use_cpu=True, bf16=False, gradient_checkpointing=False,
        num_sample_generations=0, save_strategy="no", report_to="none", logging_steps=1, seed=42,
        dataloader_num_workers=0, disable_tqdm=True)
    load = lambda cls, path: cls.from_pretrained(path, dtype=torch.float32, **(  # noqa: E731
        {"num_labels": 1} if cls is AutoModelForSequenceClassification else {}))
    ends = []
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=load(AutoModelForCausalLM, a.model),
                         ref_model=load(AutoModelForCausalLM, a.model),
                         reward_model=load(AutoModelForSequenceClassification, a.rm),
                         value_model=load(AutoModelForSequenceClassification, a.rm), train_dataset=ds,
                         callbacks=[_clock(ends)])
    trainer.train()
    _save_ends(a.out, ends)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl-ppo-worker":
        trl_ppo_worker(sys.argv[2:])
    else:
        main()
