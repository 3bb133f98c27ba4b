"""KTO: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on DeepSpeed ZeRO-3, with sequence packing.

    python recipes/kto.py                                   # one process, embedded tiny model, paired task unpaired
    python recipes/kto.py --config recipes/configs/kto_tiny.yaml --desirable_weight 1.33
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/kto.py
    make cluster-run RECIPE=recipes/kto.py CONFIG=recipes/configs/kto_tiny.yaml NODES=2

KTO learns from single completions labelled desirable or undesirable (TRL's unpaired format: prompt, completion,
label); a paired dataset is split into chosen -> desirable, rejected -> undesirable (--unpair_preference_dataset).
The reference point z0 is the policy/reference KL, estimated on mismatched pairs (x_i, y_j(i)) whose partner j(i) is
fixed per example (data.mismatched_partners), so that the reference log-probs of both the target and the KL
sequences are computed once, from the initial policy, before the first update (and again on resume, before the
checkpoint is loaded). Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import get_scheduler

from verl_kit.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from verl_kit.config import TrainConfig, parse_args
from verl_kit.data import load_split, mismatched_partners, unpaired_examples
from verl_kit.distributed import (
    all_reduce_max,
    all_reduce_sum,
    clip_grad_norm,
    destroy,
    make_accelerator,
    micro_step,
    step_indices,
)
from verl_kit.errors import UserError, main_guard
from verl_kit.losses import kl_reference_point, kto_loss
from verl_kit.metrics import MetricsLogger, check_writable, setup_logging
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, resolve_model_path, uses_block_mask
from verl_kit.packing import forward_logits, sequence_logprobs, split_by_tokens
from verl_kit.scoring import completion_sequences, make_batch, score_items

logger = logging.getLogger("verl_kit")


@dataclass
class KTOConfig(TrainConfig):
    per_device_train_batch_size: int = field(default=16, metadata={
        "help": "unpaired examples per process per micro-step (16: the sequences of DPO's default 8 pairs)"})
    beta: float = field(default=0.1, metadata={"help": "strength of the implicit KL constraint to the reference"})
    desirable_weight: float = field(default=1.0, metadata={"help": "lambda_D, weight of desirable examples' loss"})
    undesirable_weight: float = field(default=1.0, metadata={"help": "lambda_U, weight of undesirable examples' loss"})
    unpair_preference_dataset: bool = field(default=True, metadata={
        "help": "split paired data (chosen/rejected) into desirable/undesirable completions; false rejects it"})


def sequences(exs, partner, idx, kl=False):
    """(x_i, y_i) for each i in idx, or with kl=True the mismatched (x_i, y_j(i)) that estimate the KL term."""
    return [completion_sequences(exs[i].prompt_ids, [exs[partner[i] if kl else i].completion_ids]) for i in idx]


@main_guard
def main():
    cfg = parse_args(KTOConfig)
    for name in ("beta", "desirable_weight", "undesirable_weight"):
        if not getattr(cfg, name) > 0:
            raise UserError(f"--{name}: must be > 0, got {getattr(cfg, name)}")
    accelerator = make_accelerator(cfg)
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and models -----------------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    load = lambda ds, source: unpaired_examples(ds, tokenizer, cfg.max_prompt_length, cfg.max_length, source,
                                                cfg.unpair_preference_dataset)
    train = load(load_split(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config), cfg.dataset_name)
    test_ds = cfg.dataset_test_split and load_split(cfg.dataset_name, cfg.dataset_test_split, cfg.dataset_config,
                                                    required=False)
    test = load(test_ds, f"{cfg.dataset_name}[{cfg.dataset_test_split}]") if test_ds else []
    kl_train = mismatched_partners([e.prompt_ids for e in train], cfg.seed)
    kl_test = mismatched_partners([e.prompt_ids for e in test], cfg.seed) if test else []
    both = lambda exs, partner: [completion_sequences(e.prompt_ids, [e.completion_ids, exs[partner[i]].completion_ids])
                                 for i, e in enumerate(exs)]  # target and KL sequence share the prompt: one item
    labels = lambda exs, idx: torch.tensor([exs[i].label for i in idx], dtype=torch.bool)

    # Loss aversion: the KTO paper recommends lambda_D * n_D / (lambda_U * n_U) in [1, 4/3].
    n_d = sum(e.label for e in train)
    n_u = len(train) - n_d
    balance = cfg.desirable_weight * n_d / (cfg.undesirable_weight * n_u) if n_u else math.inf
    if accelerator.is_main_process and not 1 <= balance <= 4 / 3:
        logger.warning("desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = %.3g (%d desirable, "
                       "%d undesirable) is outside [1, 4/3], the range the KTO paper recommends; adjust "
                       "--desirable_weight / --undesirable_weight", balance, n_d, n_u)

    model = load_causal_lm(model_path, cfg.attn_implementation, cfg.gradient_checkpointing)
    block_mask = uses_block_mask(model)
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world  # examples per step
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train) / per_step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand: accelerate would step it once per process

    # ---- reference log-probs of target and KL sequences: the initial policy, scored before any update ------------
    ref_train = score_items(accelerator, model, both(train, kl_train), cfg, pad, block_mask)  # (n, 2)
    ref_test = score_items(accelerator, model, both(test, kl_test), cfg, pad, block_mask) if test else None

    def evaluate(step):
        logratio = score_items(accelerator, model, both(test, kl_test), cfg, pad, block_mask) - ref_test
        z0 = kl_reference_point(logratio[:, 1].sum(), torch.tensor(len(test)))
        y = labels(test, range(len(test)))
        # KTO's value sigma(beta (r - z0)) classifies a completion as desirable when its log-ratio exceeds z0.
        acc = ((logratio[:, 0] > z0) == y).float().mean().item()
        losses = kto_loss(logratio[:, 0], torch.zeros(len(test)), y, z0, cfg.beta, cfg.desirable_weight,
                          cfg.undesirable_weight)
        log.log(step, {"eval/loss": losses.mean().item(), "eval/accuracy": acc, "eval/kl": z0.item(),
                       "eval/rewards/desirable": cfg.beta * logratio[y, 0].mean().item(),
                       "eval/rewards/undesirable": cfg.beta * logratio[~y, 0].mean().item()})

    resume = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    start = load_checkpoint(accelerator, resume)["step"] if resume else 0
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    if start == 0 and test:
        evaluate(0)

    # ---- training loop -------------------------------------------------------------------------------------------
    model.train()
    for step in range(start, total_steps):
        t0 = time.time()
        idx = step_indices(len(train), step, per_step, cfg.seed, rank, world)
        if cfg.max_tokens_per_microbatch:  # token budget: every rank runs the same number of micro-batches
            seq_len = lambda i, j: len(train[i].prompt_ids) + len(train[j].completion_ids)
            costs = [max(seq_len(i, i), seq_len(i, kl_train[i])) for i in idx]  # the larger of its two forwards
            n_micro = all_reduce_max(accelerator, len(split_by_tokens(costs, cfg.max_tokens_per_microbatch)))
            chunks = [[idx[i] for i in c] for c in split_by_tokens(costs, None, n_chunks=n_micro)]
        else:
            B = cfg.per_device_train_batch_size
            chunks = [idx[i:i + B] for i in range(0, len(idx), B)]

        # KL reference point z0 (KTO paper, eq. 7): the mismatched pairs of the whole step, every micro-batch of
        # every rank, summed then divided by the global count, so all examples of the step share one z0. It is
        # detached (the paper does not backpropagate through it), so these forwards keep no graph.
        kl_sums = torch.zeros(3, dtype=torch.float64)  # log-ratio sum, pairs, tokens
        with torch.no_grad():
            for ids in chunks:
                batch = make_batch(sequences(train, kl_train, ids, kl=True), cfg, pad, block_mask).to(device)
                logps = sequence_logprobs(forward_logits(model, batch), batch).cpu()
                kl_sums += torch.tensor([(logps - ref_train[ids, 1]).sum().item(), len(ids), batch.num_tokens],
                                        dtype=torch.float64)
        kl_sum, kl_count, kl_tokens = all_reduce_sum(accelerator, kl_sums.tolist())
        z0 = kl_reference_point(torch.tensor(kl_sum), torch.tensor(kl_count)).float().to(device)

        sums = torch.zeros(7, dtype=torch.float64)  # loss, n_D, n_U, logratio_D, logratio_U, correct, tokens
        for j, ids in enumerate(chunks):
            batch = make_batch(sequences(train, kl_train, ids), cfg, pad, block_mask).to(device)
            y = labels(train, ids).to(device)
            with micro_step(accelerator, model, last=j == len(chunks) - 1):
                logps = sequence_logprobs(forward_logits(model, batch), batch)
                ref = ref_train[ids, 0].to(device)
                losses = kto_loss(logps, ref, y, z0, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)
                # Mean over the examples of the global step, never over a micro-batch or a class: DDP and DeepSpeed
                # average gradients over ranks, so the rank's sum is scaled by world / per_step. A micro-batch or a
                # rank holding one class only (or one example) then weighs exactly its share, and nothing is 0/0.
                accelerator.backward(losses.sum() * world / per_step)
            r = (logps - ref).detach()
            sums += torch.tensor([losses.sum().item(), y.sum().item(), (~y).sum().item(), r[y].sum().item(),
                                  r[~y].sum().item(), ((r > z0) == y).sum().item(), batch.num_tokens],
                                 dtype=torch.float64)
        grad_norm = clip_grad_norm(accelerator, model, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss, n_des, n_und, lr_des, lr_und, correct, tokens = all_reduce_sum(accelerator, sums.tolist())
        tokens += kl_tokens
        dt = time.time() - t0
        log.advance(loss=loss / per_step)
        if (step + 1) % cfg.logging_steps == 0 or step == start:
            by_class = {}  # a class absent from the whole step has no mean: its keys are left out of the row
            if n_des:
                by_class.update({"logratio/desirable": lr_des / n_des, "rewards/desirable": cfg.beta * lr_des / n_des})
            if n_und:
                by_class.update({"logratio/undesirable": lr_und / n_und,
                                 "rewards/undesirable": cfg.beta * lr_und / n_und})
            log.log(step + 1, {"loss": loss / per_step, "kl": z0.item(), "rewards/accuracy": correct / per_step,
                               **by_class, "grad_norm": grad_norm, "learning_rate": scheduler.get_last_lr()[0],
                               "tokens_per_s": tokens / dt, "step_time_s": dt, "tokens": tokens})
        if test and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps):
            evaluate(step + 1)
        if cfg.save_steps and (step + 1) % cfg.save_steps == 0:
            save_checkpoint(accelerator, cfg.output_dir, step + 1, {"total_steps": total_steps}, cfg.save_total_limit)

    export_hf(accelerator, model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["loss", "kl", "rewards/desirable", "rewards/undesirable", "eval/accuracy", "tokens_per_s"])
    destroy()


if __name__ == "__main__":
    main()
