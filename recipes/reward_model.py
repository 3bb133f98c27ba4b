"""Reward model: Bradley-Terry on preference pairs (Ouyang et al. 2022, eq. 1) on DeepSpeed ZeRO-3, with packing.

    python recipes/reward_model.py                          # one process, embedded tiny model and preference task
    python recipes/reward_model.py --config recipes/configs/reward_model_tiny.yaml --learning_rate 1e-3
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/reward_model.py
    make cluster-run RECIPE=recipes/reward_model.py CONFIG=recipes/configs/reward_model_tiny.yaml NODES=2

The data and its loader are DPO's (prompt?, chosen, rejected; verl_kit.data.preference_examples), plus TRL's optional
`margin` column. The model is AutoModelForSequenceClassification with one label, its `score` head run at every
position so that each packed sequence's reward is read at its own last token: the last token that is not the pad
token, where HF's forward reads it (and so PPO's --reward_model_name_or_path). A tokenizer without a pad token gets
pad = EOS (models.load_tokenizer): the reward is then read at the last non-EOS token, here and in HF's forward alike.
The export in <output_dir>/final carries the tokenizer and its chat template, which PPO renders its samples with.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field

from verl_kit.algos import bradley_terry_loss, global_mean_share
from verl_kit.config import OfflineConfig, parse_args
from verl_kit.data import load_splits, preference_examples
from verl_kit.errors import main_guard
from verl_kit.metrics import MetricsLogger
from verl_kit.models import export_hf, load_tokenizer, resolve_model_path, uses_block_mask, with_lora
from verl_kit.rewards import load_reward_classifier, margins, score_rewards, sequence_rewards
from verl_kit.train import (
    Tally,
    Trainable,
    completion_sequences,
    destroy,
    make_accelerator,
    make_batch,
    micro_batches,
    param_counts,
    resume,
    save_if_due,
    step_indices,
)


@dataclass
class RewardConfig(OfflineConfig):
    center_rewards_coefficient: float | None = field(default=None, metadata={
        "help": "weight of (r_chosen + r_rejected)^2 in the loss, which centres rewards on 0 (Eisenstein et al. "
                "2023); None or 0: off"})


@main_guard
def main():
    cfg = parse_args(RewardConfig)
    accelerator = make_accelerator(cfg)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and model ------------------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    train_ds, test_ds = load_splits(cfg)
    test_source = f"{cfg.dataset_name}[{cfg.dataset_test_split}]"
    train = preference_examples(train_ds, tokenizer, cfg.max_prompt_length, cfg.max_length, cfg.dataset_name)
    test = preference_examples(test_ds, tokenizer, cfg.max_prompt_length, cfg.max_length, test_source) \
        if test_ds else []
    margin_train = margins(train_ds, cfg.dataset_name)
    margin_test = margins(test_ds, test_source) if test_ds else None
    items = lambda exs: [completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    center = cfg.center_rewards_coefficient or 0.0

    model = load_reward_classifier(model_path, pad, cfg.attn_implementation, cfg.gradient_checkpointing,
                                   cfg.load_in_4bit)
    model.classifier = with_lora(model.classifier, cfg, task_type="SEQ_CLS")  # --use_peft: adapter, trained head
    block_mask = uses_block_mask(model)
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world  # pairs per optimizer step
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train) / per_step)
    rm = Trainable(accelerator, model, cfg, cfg.learning_rate, total_steps)

    def evaluate(step):
        r = score_rewards(accelerator, rm.model, items(test), cfg, pad, block_mask, "eval")
        loss = bradley_terry_loss(r[:, 0], r[:, 1], margin_test, center)
        log.log(step, {"eval/loss": loss.mean().item(),
                       "eval/rewards/accuracy": (r[:, 0] > r[:, 1]).float().mean().item(),
                       "eval/rewards/margin": (r[:, 0] - r[:, 1]).mean().item(), "eval/rewards/mean": r.mean().item()})

    start = resume(accelerator, cfg)
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    if start == 0:
        local, total = param_counts(rm.model)
        log.log(0, {"world_size": world, "params/total": total, "params/local": local, "pairs/train": len(train),
                    "pairs/test": len(test)})
        if test:
            evaluate(0)

    # ---- training loop -------------------------------------------------------------------------------------------
    rm.model.train()
    for step in range(start, total_steps):
        t0 = time.time()
        idx = step_indices(len(train), step, per_step, cfg.seed, rank, world)
        costs = [2 * len(train[i].prompt_ids) + len(train[i].chosen_ids) + len(train[i].rejected_ids) for i in idx]
        chunks = micro_batches(cfg, idx, costs)
        tally = Tally()
        for chunk in rm.accumulate(chunks):
            batch = make_batch(items([train[i] for i in chunk]), cfg, pad, block_mask).to(device)
            r = sequence_rewards(rm.model(batch.input_ids, batch.attention_mask, batch.position_ids), batch, pad)
            r = r.view(-1, 2)  # (pairs, [chosen, rejected])
            m = margin_train[chunk].to(device) if margin_train is not None else None
            losses = bradley_terry_loss(r[:, 0], r[:, 1], m, center)
            # Mean over the pairs of the global step: the rank's sum times world / per_step, as in recipes/dpo.py.
            rm.backward(global_mean_share(losses, per_step, world))
            r = r.detach()
            tally.add(loss=losses.detach(), correct=r[:, 0] > r[:, 1], margin=r[:, 0] - r[:, 1], chosen=r[:, 0],
                      rejected=r[:, 1], tokens=batch.num_tokens)
        grad_norm = rm.step()
        t = tally.reduce()
        dt = time.time() - t0
        log.advance(loss=t["loss"] / per_step)
        if (step + 1) % cfg.logging_steps == 0 or step == start:
            log.log(step + 1, {"loss": t["loss"] / per_step, "rewards/accuracy": t["correct"] / per_step,
                               "rewards/margin": t["margin"] / per_step, "rewards/chosen": t["chosen"] / per_step,
                               "rewards/rejected": t["rejected"] / per_step, "grad_norm": grad_norm,
                               "learning_rate": rm.learning_rate, "perf/tokens_per_s": t["tokens"] / dt,
                               "timing_s/step": dt, "tokens": t["tokens"]})
        if test and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps):
            evaluate(step + 1)
        save_if_due(accelerator, cfg, step + 1)

    export_hf(accelerator, rm.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["loss", "rewards/accuracy", "eval/rewards/accuracy", "perf/tokens_per_s"])
    destroy()


if __name__ == "__main__":
    main()
