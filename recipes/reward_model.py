"""Reward model: Bradley-Terry on preference pairs (Ouyang et al. 2022, eq. 1) on DeepSpeed ZeRO-3, with packing.

    python recipes/reward_model.py                          # one process, embedded tiny model and preference task
    python recipes/reward_model.py --config recipes/configs/reward_model_tiny.yaml --learning_rate 1e-3
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/reward_model.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/reward_model.py  # FSDP2
    make cluster-run RECIPE=recipes/reward_model.py CONFIG=recipes/configs/reward_model_tiny.yaml NODES=2

The data and its loader are DPO's (prompt?, chosen, rejected; verl_kit.data.preference_examples), plus TRL's optional
`margin` column. The model is AutoModelForSequenceClassification with one label, its `score` head run at every
position so that each packed sequence's reward is read at its own last token: the last token that is not the pad
token, where HF's forward reads it (and so PPO's --reward_model_name_or_path). A tokenizer without a pad token gets
pad = EOS (models.load_tokenizer): the reward is then read at the last non-EOS token, here and in HF's forward alike.
The export in <output_dir>/final carries the tokenizer and its chat template, which PPO renders its samples with.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import time
from dataclasses import dataclass, field

from verl_kit import algos, config, data, models, rewards, train
from verl_kit.errors import main_guard
from verl_kit.metrics import MetricsLogger, pair_metrics, pair_sums


@dataclass
class RewardModelConfig(config.Config):
    """The reward model's own knob; the rest of its flags are config.OfflineConfig's."""

    center_rewards_coefficient: float | None = field(default=None, metadata={
        "help": "weight of (r_chosen + r_rejected)^2 in the loss, which centres rewards on 0 (Eisenstein et al. "
                "2023); None or 0: off"})


ARGS = {"reward_model": RewardModelConfig, "train": config.OfflineConfig}  # by role: recipes/reward_model.py --help


@main_guard
def main():
    cfg = config.parse(**ARGS)
    tc, flags = cfg.train, cfg.flags()
    accelerator = train.make_accelerator(tc)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and model ------------------------------------------------------------------------------------------
    model_path = models.resolve_model_path(tc.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs)
    pad = tokenizer.pad_token_id
    train_ds, test_ds = data.load_splits(tc)
    test_source = tc.test_source
    pairs = data.preference_examples(train_ds, tokenizer, tc.max_prompt_length, tc.max_length, tc.train_source)
    sources = data.row_sources(train_ds, len(pairs))  # data/source_share/* of a mixture's steps
    test = data.preference_examples(test_ds, tokenizer, tc.max_prompt_length, tc.max_length, test_source) \
        if test_ds else []
    margin_train = rewards.margins(train_ds, tc.train_source)
    margin_test = rewards.margins(test_ds, test_source) if test_ds else None
    items = lambda exs: [train.completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    center = cfg.reward_model.center_rewards_coefficient or 0.0

    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    memory = train.plan_memory(accelerator, tc, model_path, [e.cost for e in pairs])
    model = rewards.load_reward_classifier(model_path, pad, tc.attn_implementation, tc.gradient_checkpointing,
                                           tc.load_in_4bit)
    model.classifier = models.with_lora(model.classifier, tc, task_type="SEQ_CLS")  # --use_peft: adapter, trained head
    block_mask = models.uses_block_mask(model)
    per_step = tc.per_device_train_batch_size * tc.gradient_accumulation_steps * world  # pairs per optimizer step
    total_steps = tc.total_steps(len(pairs), per_step)
    rm = train.Trainable(accelerator, model, tc, tc.learning_rate, total_steps)

    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, tc, cfg.resume_checked())
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    log = MetricsLogger(accelerator, tc.output_dir, total_steps, start, flags, tc.run_name)

    def evaluate():
        r = rewards.score_rewards(accelerator, rm.model, items(test), tc, pad, block_mask, "eval")
        loss = algos.bradley_terry_loss(r[:, 0], r[:, 1], margin_test, center)
        return {"eval/loss": loss.mean().item(), "eval/rewards/accuracy": (r[:, 0] > r[:, 1]).float().mean().item(),
                "eval/rewards/margin": (r[:, 0] - r[:, 1]).mean().item(), "eval/rewards/mean": r.mean().item()}

    if start == 0:
        log.log(0, {**rm.size_metrics(), **memory.metrics(), "pairs/train": len(pairs), "pairs/test": len(test),
                    **(evaluate() if test else {})})

    # ---- training loop -------------------------------------------------------------------------------------------
    rm.model.train()
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        t0 = time.time()
        idx = train.step_indices(len(pairs), step, per_step, tc.seed, rank, world)
        costs = [pairs[i].cost for i in idx]
        tally = train.Tally()
        for attempt in rm.attempts(tc, step, idx, costs, tally):  # out of memory: redone at half the tokens
            with attempt:
                for chunk in rm.accumulate(attempt.chunks):
                    batch = train.make_batch(items([pairs[i] for i in chunk]), tc, pad, block_mask).to(device)
                    r = rewards.sequence_rewards(rm.model(**batch.inputs()), batch, pad)
                    r = r.view(-1, 2)  # (pairs, [chosen, rejected])
                    m = margin_train[chunk].to(device) if margin_train is not None else None
                    losses = algos.bradley_terry_loss(r[:, 0], r[:, 1], m, center)
                    # Mean over the pairs of the global step: the rank's sum times world / per_step (recipes/dpo.py)
                    rm.backward(algos.global_mean_share(losses, per_step, world))
                    tally.add(**pair_sums(losses, r), tokens=batch.num_tokens)
                grad_norm = rm.step()
        t = tally.reduce()
        dt = time.time() - t0
        metrics = {**pair_metrics(t, per_step), **rm.metrics([grad_norm]), "perf/tokens_per_s": t["tokens"] / dt,
                   "timing_s/step": dt, "tokens": t["tokens"], **sources.metrics(idx)}
        log.end_step(step + 1, metrics, tc.logging_steps, tc.eval_steps, evaluate if test else None, "loss")
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    if not stop:
        train.export_final(accelerator, rm.model, tokenizer, tc.output_dir, total_steps)
        log.close(["loss", "rewards/accuracy", "eval/rewards/accuracy", "perf/tokens_per_s"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
