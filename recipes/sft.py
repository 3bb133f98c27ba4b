"""SFT: supervised fine-tuning on DeepSpeed ZeRO-3, with exact padding-free packing.

    python recipes/sft.py                                   # one process, embedded tiny model and SFT task
    python recipes/sft.py --config recipes/configs/sft_tiny.yaml --learning_rate 1e-3
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/sft.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/sft.py   # or PyTorch FSDP2
    make cluster-run RECIPE=recipes/sft.py CONFIG=recipes/configs/sft_tiny.yaml NODES=2

Data in TRL's SFT formats as they are: `text`, `prompt` + `completion`, or `messages` rendered with the tokenizer's
chat template (verl_kit.data). By default only the completion / the assistant turns are learned. The loss is the mean
negative log-likelihood over every learned token of the optimizer step, on all processes and micro-batches, so it does
not depend on how the step is split. Packed sequences never attend to each other (verl_kit.data.packing).
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import time
from dataclasses import dataclass, field

from verl_kit import algos, config, data, models, train
from verl_kit.errors import main_guard
from verl_kit.metrics import MetricsLogger


@dataclass
class SFTConfig(config.Config):
    """SFT's own knobs: which tokens are learned; the rest of its flags are the training role's."""

    dataset_text_field: str = field(default="text", metadata={"help": "the column of language-modeling rows"})
    completion_only_loss: bool | None = field(default=None, metadata={
        "help": "prompt/completion rows: learn the completion only (default) or, if false, the whole sequence"})
    assistant_only_loss: bool | None = field(default=None, metadata={
        "help": "messages rows: learn the assistant turns only (default; TRL's default is false) or, if false, the "
                "whole conversation"})


@dataclass
class SFTTrainConfig(config.OfflineConfig):
    """config.OfflineConfig with the embedded SFT task as its default data."""

    dataset_name: str = field(default=data.TINY_SFT, metadata={
        "help": "hub dataset name, or a local .jsonl/.json/.parquet file or a directory of them (text, prompt + "
                "completion, or messages rows)"})


ARGS = {"sft": SFTConfig, "train": SFTTrainConfig}  # the flags, by role: python recipes/sft.py --help


@main_guard
def main():
    cfg = config.parse(**ARGS)
    sft, tc, flags = cfg.sft, cfg.train, cfg.flags()
    accelerator = train.make_accelerator(tc)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and model ------------------------------------------------------------------------------------------
    model_path = models.resolve_model_path(tc.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs)
    pad = tokenizer.pad_token_id
    train_ds, test_ds = data.load_splits(tc)
    load = lambda ds, source: data.sft_examples(ds, tokenizer, tc.max_prompt_length, tc.max_length, source,
                                                sft.dataset_text_field, sft.completion_only_loss,
                                                sft.assistant_only_loss)
    examples = load(train_ds, tc.train_source)
    sources = data.row_sources(train_ds, len(examples))  # data/source_share/* of a mixture's steps
    test = load(test_ds, tc.test_source) if test_ds else []
    items = lambda exs: [([e.input_ids], [e.loss_mask]) for e in exs]  # one scored sequence per example
    learned = lambda exs: sum(sum(e.loss_mask) for e in exs)

    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    memory = train.plan_memory(accelerator, tc, model_path, [len(e.input_ids) for e in examples])
    model = models.load_policy(model_path, tc)  # with its LoRA adapter when --use_peft
    block_mask = models.uses_block_mask(model)
    per_step = tc.per_device_train_batch_size * tc.gradient_accumulation_steps * world  # sequences per step
    total_steps = tc.total_steps(len(examples), per_step)
    policy = train.Trainable(accelerator, model, tc, tc.learning_rate, total_steps)

    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, tc, cfg.resume_checked())
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    log = MetricsLogger(accelerator, tc.output_dir, total_steps, start, flags, tc.run_name)

    def evaluate():  # token-mean NLL over the whole held-out split, and its perplexity
        logps = train.score_items(accelerator, policy.model, items(test), tc, pad, block_mask, "eval")
        loss = -logps.sum().item() / learned(test)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}

    if start == 0:
        log.log(0, {**policy.size_metrics(), **memory.metrics(), "sequences/train": len(examples),
                    "sequences/test": len(test), "learned_tokens/train": learned(examples),
                    **(evaluate() if test else {})})

    # ---- training loop -------------------------------------------------------------------------------------------
    policy.model.train()
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        t0 = time.time()
        idx = train.step_indices(len(examples), step, per_step, tc.seed, rank, world)
        # Token mean over the learned tokens of the whole step: each micro-batch adds sum(nll) * world / n_tokens,
        # which DDP/DeepSpeed's average over processes turns into sum over all tokens / n_tokens (global_mean_share).
        n_tokens = train.reduce_metrics({"n": learned([examples[i] for i in idx])})["n"]
        tally = train.Tally()
        # the step's micro-batches; a try that runs out of memory is undone and redone at half the tokens
        for attempt in policy.attempts(tc, step, idx, [len(examples[i].input_ids) for i in idx], tally):
            with attempt:
                for chunk in policy.accumulate(attempt.chunks):
                    batch = train.make_batch(items([examples[i] for i in chunk]), tc, pad, block_mask).to(device)
                    logps, _ = train.token_logprobs(policy.model, batch)
                    policy.backward(algos.global_mean_share(-logps, n_tokens, world))
                    tally.add(nll=-logps.detach(), tokens=batch.num_tokens)
                grad_norm = policy.step()
        t = tally.reduce()
        dt = time.time() - t0
        metrics = {"loss": t["nll"] / n_tokens, **policy.metrics([grad_norm]), "learned_tokens": n_tokens,
                   "tokens": t["tokens"], "perf/tokens_per_s": t["tokens"] / dt, "timing_s/step": dt,
                   **sources.metrics(idx)}
        log.end_step(step + 1, metrics, tc.logging_steps, tc.eval_steps, evaluate if test else None, "loss")
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    if not stop:
        train.export_final(accelerator, policy.model, tokenizer, tc.output_dir, total_steps)
        log.close(["loss", "eval/loss", "perf/tokens_per_s"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
