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

from verl_kit.algos import global_mean_share, kl_reference_point, kto_loss
from verl_kit.config import OfflineConfig, parse_args
from verl_kit.data import forward_logits, load_splits, mismatched_partners, sequence_logprobs, unpaired_examples
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, resolve_model_path, uses_block_mask, with_lora
from verl_kit.train import (
    Tally,
    Trainable,
    completion_sequences,
    destroy,
    make_accelerator,
    make_batch,
    micro_batches,
    resume,
    save_if_due,
    score_items,
    score_subset,
    step_indices,
    steps_indices,
)

logger = logging.getLogger("verl_kit")


@dataclass
class KTOConfig(OfflineConfig):
    per_device_train_batch_size: int = field(default=16, metadata={
        "help": "unpaired examples per process per micro-step (16: the sequences of DPO's default 8 pairs)"})
    beta: float = field(default=0.1, metadata={
        "help": "temperature of the implicit reward beta * log(pi / pi_ref) inside KTO's value function: higher "
                "keeps the policy nearer the reference"})
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
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and models -----------------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    load = lambda ds, source: unpaired_examples(ds, tokenizer, cfg.max_prompt_length, cfg.max_length, source,
                                                cfg.unpair_preference_dataset)
    train_ds, test_ds = load_splits(cfg)
    train = load(train_ds, cfg.dataset_name)
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

    model = with_lora(load_causal_lm(model_path, cfg.attn_implementation, cfg.gradient_checkpointing,
                                     cfg.load_in_4bit), cfg)
    block_mask = uses_block_mask(model)
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world  # examples per step
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train) / per_step)
    policy = Trainable(accelerator, model, cfg, cfg.learning_rate, total_steps)

    # ---- reference log-probs of target and KL sequences: the initial policy, scored before any update ------------
    score = lambda exs, partner, desc: score_items(accelerator, policy.model, both(exs, partner), cfg, pad, block_mask,
                                                   desc)  # (n, 2)
    needed = steps_indices(len(train), range(total_steps), per_step, cfg.seed)  # what the run reads
    ref_train = score_subset(accelerator, policy.model, both(train, kl_train), needed, cfg, pad, block_mask,
                             "reference train")
    ref_test = score(test, kl_test, "reference test") if test else None

    def evaluate(step):
        logratio = score(test, kl_test, "eval") - ref_test
        z0 = kl_reference_point(logratio[:, 1].sum(), torch.tensor(len(test)))
        y = labels(test, range(len(test)))
        # KTO's value sigma(beta (r - z0)) classifies a completion as desirable when its log-ratio exceeds z0.
        acc = ((logratio[:, 0] > z0) == y).float().mean().item()
        losses = kto_loss(logratio[:, 0], torch.zeros(len(test)), y, z0, cfg.beta, cfg.desirable_weight,
                          cfg.undesirable_weight)
        log.log(step, {"eval/loss": losses.mean().item(), "eval/rewards/accuracy": acc, "eval/kl": z0.item(),
                       "eval/rewards/desirable": cfg.beta * logratio[y, 0].mean().item(),
                       "eval/rewards/undesirable": cfg.beta * logratio[~y, 0].mean().item()})

    start = resume(accelerator, cfg)
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    if start == 0 and test:
        evaluate(0)

    # ---- training loop -------------------------------------------------------------------------------------------
    policy.model.train()
    for step in range(start, total_steps):
        t0 = time.time()
        idx = step_indices(len(train), step, per_step, cfg.seed, rank, world)
        seq_len = lambda i, j: len(train[i].prompt_ids) + len(train[j].completion_ids)
        costs = [max(seq_len(i, i), seq_len(i, kl_train[i])) for i in idx]  # the larger of its two forwards
        chunks = micro_batches(cfg, idx, costs)

        # KL reference point z0 (KTO paper, eq. 7): the mismatched pairs of the whole step, every micro-batch of
        # every rank, summed then divided by the global count, so all examples of the step share one z0. It is
        # detached (the paper does not backpropagate through it), so these forwards keep no graph.
        kl = Tally()
        with torch.no_grad():
            for ids in chunks:
                batch = make_batch(sequences(train, kl_train, ids, kl=True), cfg, pad, block_mask).to(device)
                logps = sequence_logprobs(forward_logits(policy.model, batch), batch).cpu()
                kl.add(logratio=logps - ref_train[ids, 1], pairs=len(ids), tokens=batch.num_tokens)
        kl = kl.reduce()
        z0 = kl_reference_point(torch.tensor(kl["logratio"]), torch.tensor(kl["pairs"])).float().to(device)

        tally = Tally()
        for ids in policy.accumulate(chunks):
            batch = make_batch(sequences(train, kl_train, ids), cfg, pad, block_mask).to(device)
            y = labels(train, ids).to(device)
            logps = sequence_logprobs(forward_logits(policy.model, batch), batch)
            ref = ref_train[ids, 0].to(device)
            losses = kto_loss(logps, ref, y, z0, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)
            # Mean over the examples of the global step, never over a micro-batch or a class: DDP and DeepSpeed
            # average gradients over ranks, so the rank's sum is scaled by world / per_step. A micro-batch or a
            # rank holding one class only (or one example) then weighs exactly its share, and nothing is 0/0.
            policy.backward(global_mean_share(losses, per_step, world))
            r = (logps - ref).detach()
            tally.add(loss=losses.detach(), n_des=y, n_und=~y, logratio_des=r[y], logratio_und=r[~y],
                      correct=(r > z0) == y, tokens=batch.num_tokens)
        grad_norm = policy.step()
        t = tally.reduce()
        tokens = t["tokens"] + kl["tokens"]
        dt = time.time() - t0
        log.advance(loss=t["loss"] / per_step)
        if (step + 1) % cfg.logging_steps == 0 or step == start:
            by_class = {}  # a class absent from the whole step has no mean: its keys are left out of the row
            for cls in ("desirable", "undesirable"):
                n, lr = t[f"n_{cls[:3]}"], t[f"logratio_{cls[:3]}"]
                if n:
                    by_class.update({f"logratio/{cls}": lr / n, f"rewards/{cls}": cfg.beta * lr / n})
            log.log(step + 1, {"loss": t["loss"] / per_step, "kl": z0.item(),
                               "rewards/accuracy": t["correct"] / per_step, **by_class, "grad_norm": grad_norm,
                               "learning_rate": policy.learning_rate,
                               "perf/tokens_per_s": tokens / dt, "timing_s/step": dt, "tokens": tokens})
        if test and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps):
            evaluate(step + 1)
        save_if_due(accelerator, cfg, step + 1)

    export_hf(accelerator, policy.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["loss", "kl", "rewards/desirable", "rewards/undesirable", "eval/rewards/accuracy", "perf/tokens_per_s"])
    destroy()


if __name__ == "__main__":
    main()
