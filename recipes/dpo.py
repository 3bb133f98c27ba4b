"""DPO: Direct Preference Optimization (Rafailov et al. 2023) on DeepSpeed ZeRO-3, with sequence packing.

    python recipes/dpo.py                                   # one process, embedded tiny model and task
    python recipes/dpo.py --config recipes/configs/dpo_tiny.yaml --learning_rate 1e-3
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/dpo.py
    make cluster-run RECIPE=recipes/dpo.py CONFIG=recipes/configs/dpo_tiny.yaml NODES=2

The reference model is the initial policy: its log-probs are computed once, before the first update (and again on
resume, before the checkpoint is loaded), so no second model sits in memory beside the ZeRO-3 policy.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import get_scheduler

from verl_kit.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from verl_kit.config import TrainConfig, parse_args
from verl_kit.data import load_split, preference_examples
from verl_kit.distributed import (
    all_reduce_max,
    all_reduce_sum,
    clip_grad_norm,
    destroy,
    make_accelerator,
    micro_step,
    param_counts,
    step_indices,
)
from verl_kit.errors import UserError, main_guard
from verl_kit.losses import dpo_loss, implicit_rewards
from verl_kit.metrics import MetricsLogger, check_writable, setup_logging
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, resolve_model_path, uses_block_mask
from verl_kit.packing import forward_logits, sequence_logprobs, split_by_tokens
from verl_kit.scoring import completion_sequences, make_batch, score_items


@dataclass
class DPOConfig(TrainConfig):
    beta: float = field(default=0.1, metadata={"help": "strength of the implicit KL constraint to the reference"})
    loss_type: str = field(default="sigmoid", metadata={"help": "sigmoid (DPO) or ipo"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "assumed fraction of flipped labels: conservative DPO (sigmoid loss only)"})


def length_average(logps, ref, lengths, cfg):
    """Policy and reference log-probs (B, 2) as the loss wants them: IPO compares length-averaged log-probs
    (Azar et al. 2023, section 5.2), DPO compares sums."""
    if cfg.loss_type == "ipo":
        logps, ref = logps / lengths, ref / lengths
    return logps, ref


@main_guard
def main():
    cfg = parse_args(DPOConfig)
    if cfg.loss_type not in ("sigmoid", "ipo"):
        raise UserError(f"--loss_type: {cfg.loss_type!r} is not one of sigmoid, ipo")
    accelerator = make_accelerator(cfg)
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and models -----------------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    train = preference_examples(load_split(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config),
                                tokenizer, cfg.max_prompt_length, cfg.max_length, cfg.dataset_name)
    test_ds = cfg.dataset_test_split and load_split(cfg.dataset_name, cfg.dataset_test_split, cfg.dataset_config,
                                                    required=False)
    test = preference_examples(test_ds, tokenizer, cfg.max_prompt_length, cfg.max_length,
                               f"{cfg.dataset_name}[{cfg.dataset_test_split}]") if test_ds else []
    items = lambda exs: [completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    lengths = lambda exs: torch.tensor([[len(e.chosen_ids), len(e.rejected_ids)] for e in exs], dtype=torch.float32)

    model = load_causal_lm(model_path, cfg.attn_implementation, cfg.gradient_checkpointing)
    block_mask = uses_block_mask(model)
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world  # pairs per optimizer step
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train) / per_step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand: accelerate would step it once per process

    # ---- reference log-probs: the initial policy, scored before any update ---------------------------------------
    ref_train = score_items(accelerator, model, items(train), cfg, pad, block_mask)
    ref_test = score_items(accelerator, model, items(test), cfg, pad, block_mask) if test else None

    def evaluate(step):
        logps = score_items(accelerator, model, items(test), cfg, pad, block_mask)
        pol, ref = length_average(logps, ref_test, lengths(test), cfg)
        rewards = implicit_rewards(pol, ref, cfg.beta)
        acc = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
        loss = dpo_loss(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], cfg.beta, cfg.loss_type, cfg.label_smoothing)
        log.log(step, {"eval/loss": loss.mean().item(), "eval/preference_accuracy": acc,
                       "eval/reward_margin": (rewards[:, 0] - rewards[:, 1]).mean().item()})

    resume = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    start = load_checkpoint(accelerator, resume)["step"] if resume else 0
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    if start == 0:
        local, total = param_counts(model)
        log.log(0, {"world_size": world, "params/total": total, "params/local": local, "pairs/train": len(train),
                    "pairs/test": len(test)})
        if test:
            evaluate(0)

    # ---- training loop -------------------------------------------------------------------------------------------
    model.train()
    for step in range(start, total_steps):
        t0 = time.time()
        idx = step_indices(len(train), step, per_step, cfg.seed, rank, world)
        if cfg.max_tokens_per_microbatch:  # token budget: every rank runs the same number of micro-batches
            costs = [2 * len(train[i].prompt_ids) + len(train[i].chosen_ids) + len(train[i].rejected_ids) for i in idx]
            n_micro = all_reduce_max(accelerator, len(split_by_tokens(costs, cfg.max_tokens_per_microbatch)))
            chunks = split_by_tokens(costs, None, n_chunks=n_micro)
        else:
            B = cfg.per_device_train_batch_size
            chunks = [list(range(i, i + B)) for i in range(0, len(idx), B)]
        sums = torch.zeros(6, dtype=torch.float64)  # loss, correct, margin, chosen reward, rejected reward, tokens
        for j, chunk in enumerate(chunks):
            exs = [train[idx[i]] for i in chunk]
            batch = make_batch(items(exs), cfg, pad, block_mask).to(device)
            with micro_step(accelerator, model, last=j == len(chunks) - 1):
                logps = sequence_logprobs(forward_logits(model, batch), batch).view(-1, 2)
                ref = ref_train[[idx[i] for i in chunk]].to(device)
                pol, ref = length_average(logps, ref, lengths(exs).to(device), cfg)
                losses = dpo_loss(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], cfg.beta, cfg.loss_type,
                                  cfg.label_smoothing)
                # Mean over the pairs of the global step. DDP and DeepSpeed average gradients over ranks, so the
                # rank's sum is scaled by world / per_step; the result does not depend on how pairs are split.
                accelerator.backward(losses.sum() * world / per_step)
            r = implicit_rewards(pol, ref, cfg.beta)
            sums += torch.tensor([losses.sum().item(), (r[:, 0] > r[:, 1]).sum().item(),
                                  (r[:, 0] - r[:, 1]).sum().item(), r[:, 0].sum().item(), r[:, 1].sum().item(),
                                  batch.num_tokens], dtype=torch.float64)
        grad_norm = clip_grad_norm(accelerator, model, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss, correct, margin, chosen, rejected, tokens = all_reduce_sum(accelerator, sums.tolist())
        dt = time.time() - t0
        log.advance(loss=loss / per_step)
        if (step + 1) % cfg.logging_steps == 0 or step == start:
            log.log(step + 1, {"loss": loss / per_step, "rewards/accuracy": correct / per_step,
                               "rewards/margin": margin / per_step, "rewards/chosen": chosen / per_step,
                               "rewards/rejected": rejected / per_step, "grad_norm": grad_norm,
                               "learning_rate": scheduler.get_last_lr()[0], "tokens_per_s": tokens / dt,
                               "step_time_s": dt, "tokens": tokens})
        if test and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps):
            evaluate(step + 1)
        if cfg.save_steps and (step + 1) % cfg.save_steps == 0:
            save_checkpoint(accelerator, cfg.output_dir, step + 1, {"total_steps": total_steps}, cfg.save_total_limit)

    export_hf(accelerator, model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["loss", "rewards/accuracy", "rewards/margin", "eval/preference_accuracy", "tokens_per_s"])
    destroy()


if __name__ == "__main__":
    main()
