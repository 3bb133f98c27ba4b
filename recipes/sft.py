"""SFT: supervised fine-tuning on DeepSpeed ZeRO-3, with exact padding-free packing.

    python recipes/sft.py                                   # one process, embedded tiny model and SFT task
    python recipes/sft.py --config recipes/configs/sft_tiny.yaml --learning_rate 1e-3
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/sft.py
    make cluster-run RECIPE=recipes/sft.py CONFIG=recipes/configs/sft_tiny.yaml NODES=2

Data in TRL's SFT formats as they are: `text`, `prompt` + `completion`, or `messages` rendered with the tokenizer's
chat template (verl_kit.data). By default only the completion / the assistant turns are learned. The loss is the mean
negative log-likelihood over every learned token of the optimizer step, on all processes and micro-batches, so it does
not depend on how the step is split. Packed sequences never attend to each other (verl_kit.data.packing).
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field

from verl_kit.algos import global_mean_share
from verl_kit.config import OfflineConfig, parse_args
from verl_kit.data import TINY_SFT, forward_logits, load_splits, sft_examples, token_logprobs
from verl_kit.errors import main_guard
from verl_kit.metrics import MetricsLogger
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, resolve_model_path, uses_block_mask, with_lora
from verl_kit.train import (
    Tally,
    Trainable,
    destroy,
    make_accelerator,
    make_batch,
    micro_batches,
    param_counts,
    reduce_metrics,
    resume,
    save_if_due,
    score_items,
    step_indices,
)


@dataclass
class SFTConfig(OfflineConfig):
    dataset_name: str = field(default=TINY_SFT, metadata={
        "help": "hub dataset name, or a local .jsonl/.json/.parquet file or a directory of them (text, prompt + "
                "completion, or messages rows)"})
    dataset_text_field: str = field(default="text", metadata={"help": "the column of language-modeling rows"})
    completion_only_loss: bool | None = field(default=None, metadata={
        "help": "prompt/completion rows: learn the completion only (default) or, if false, the whole sequence"})
    assistant_only_loss: bool | None = field(default=None, metadata={
        "help": "messages rows: learn the assistant turns only (default; TRL's default is false) or, if false, the "
                "whole conversation"})


@main_guard
def main():
    cfg = parse_args(SFTConfig)
    accelerator = make_accelerator(cfg)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and model ------------------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    train_ds, test_ds = load_splits(cfg)
    examples = lambda ds, source: sft_examples(ds, tokenizer, cfg.max_prompt_length, cfg.max_length, source,
                                               cfg.dataset_text_field, cfg.completion_only_loss,
                                               cfg.assistant_only_loss)
    train = examples(train_ds, cfg.dataset_name)
    test = examples(test_ds, f"{cfg.dataset_name}[{cfg.dataset_test_split}]") if test_ds else []
    items = lambda exs: [([e.input_ids], [e.loss_mask]) for e in exs]  # one scored sequence per example
    learned = lambda exs: sum(sum(e.loss_mask) for e in exs)

    model = with_lora(load_causal_lm(model_path, cfg.attn_implementation, cfg.gradient_checkpointing,
                                     cfg.load_in_4bit), cfg)
    block_mask = uses_block_mask(model)
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world  # sequences per step
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train) / per_step)
    policy = Trainable(accelerator, model, cfg, cfg.learning_rate, total_steps)

    def evaluate(step):  # token-mean NLL over the whole held-out split, and its perplexity
        logps = score_items(accelerator, policy.model, items(test), cfg, pad, block_mask, "eval")
        loss = -logps.sum().item() / learned(test)
        log.log(step, {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))})

    start = resume(accelerator, cfg)
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    if start == 0:
        local, total = param_counts(policy.model)
        log.log(0, {"world_size": world, "params/total": total, "params/local": local, "sequences/train": len(train),
                    "sequences/test": len(test), "learned_tokens/train": learned(train)})
        if test:
            evaluate(0)

    # ---- training loop -------------------------------------------------------------------------------------------
    policy.model.train()
    for step in range(start, total_steps):
        t0 = time.time()
        idx = step_indices(len(train), step, per_step, cfg.seed, rank, world)
        chunks = micro_batches(cfg, idx, [len(train[i].input_ids) for i in idx])
        # Token mean over the learned tokens of the whole step: each micro-batch adds sum(nll) * world / n_tokens,
        # which DDP/DeepSpeed's average over processes turns into sum over all tokens / n_tokens (global_mean_share).
        n_tokens = reduce_metrics({"n": learned([train[i] for i in idx])})["n"]
        tally = Tally()
        for chunk in policy.accumulate(chunks):
            batch = make_batch(items([train[i] for i in chunk]), cfg, pad, block_mask).to(device)
            logps, _ = token_logprobs(forward_logits(policy.model, batch), batch)
            policy.backward(global_mean_share(-logps, n_tokens, world))
            tally.add(nll=-logps.detach(), tokens=batch.num_tokens)
        grad_norm = policy.step()
        t = tally.reduce()
        dt = time.time() - t0
        log.advance(loss=t["nll"] / n_tokens)
        if (step + 1) % cfg.logging_steps == 0 or step == start:
            log.log(step + 1, {"loss": t["nll"] / n_tokens, "grad_norm": grad_norm,
                               "learning_rate": policy.learning_rate, "learned_tokens": n_tokens, "tokens": t["tokens"],
                               "perf/tokens_per_s": t["tokens"] / dt, "timing_s/step": dt})
        if test and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps):
            evaluate(step + 1)
        save_if_due(accelerator, cfg, step + 1)

    export_hf(accelerator, policy.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["loss", "eval/loss", "perf/tokens_per_s"])
    destroy()


if __name__ == "__main__":
    main()
