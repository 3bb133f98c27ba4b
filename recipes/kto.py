"""KTO: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on DeepSpeed ZeRO-3, with sequence packing.

    python recipes/kto.py                                   # one process, embedded tiny model, paired task unpaired
    python recipes/kto.py --config recipes/configs/kto_tiny.yaml --desirable_weight 1.33
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/kto.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/kto.py   # or PyTorch FSDP2
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
import time
from dataclasses import dataclass, field

import torch

from verl_kit import algos, config, data, models, train
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger

logger = logging.getLogger("verl_kit")


@dataclass
class KTOConfig(config.Config):
    """KTO's own knobs: the value function's temperature and class weights, the data's form; the rest of its flags
    are the training role's."""

    beta: float = field(default=0.1, metadata={
        "help": "temperature of the implicit reward beta * log(pi / pi_ref) inside KTO's value function: higher "
                "keeps the policy nearer the reference"})
    desirable_weight: float = field(default=1.0, metadata={"help": "lambda_D, weight of desirable examples' loss"})
    undesirable_weight: float = field(default=1.0, metadata={"help": "lambda_U, weight of undesirable examples' loss"})
    unpair_preference_dataset: bool = field(default=True, metadata={
        "help": "split paired data (chosen/rejected) into desirable/undesirable completions; false rejects it"})

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name}: must be > 0, got {getattr(self, name)}")


@dataclass
class KTOTrainConfig(config.OfflineConfig):
    """config.OfflineConfig with KTO's default batch: as many sequences as DPO's."""

    per_device_train_batch_size: int = field(default=16, metadata={
        "help": "unpaired examples per process per micro-step (16: the sequences of DPO's default 8 pairs)"})


ARGS = {"kto": KTOConfig, "train": KTOTrainConfig}  # the flags, by role: python recipes/kto.py --help


def sequences(exs, partner, idx, kl=False):
    """(x_i, y_i) for each i in idx, or with kl=True the mismatched (x_i, y_j(i)) that estimate the KL term."""
    return [train.completion_sequences(exs[i].prompt_ids, [exs[partner[i] if kl else i].completion_ids]) for i in idx]


@main_guard
def main():
    cfg = config.parse(**ARGS)
    kto, tc, flags = cfg.kto, cfg.train, cfg.flags()
    accelerator = train.make_accelerator(tc)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    # ---- data and models -----------------------------------------------------------------------------------------
    model_path = models.resolve_model_path(tc.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs)
    pad = tokenizer.pad_token_id
    load = lambda ds, source: data.unpaired_examples(ds, tokenizer, tc.max_prompt_length, tc.max_length, source,
                                                     kto.unpair_preference_dataset)
    train_ds, test_ds = data.load_splits(tc)
    examples = load(train_ds, tc.train_source)
    sources = data.row_sources(train_ds, len(examples))  # data/source_share/* of a mixture's steps
    test = load(test_ds, tc.test_source) if test_ds else []
    kl_train = data.mismatched_partners([e.prompt_ids for e in examples], tc.seed)
    kl_test = data.mismatched_partners([e.prompt_ids for e in test], tc.seed) if test else []
    both = lambda exs, partner: [  # target and KL sequence share the prompt: one item
        train.completion_sequences(e.prompt_ids, [e.completion_ids, exs[partner[i]].completion_ids])
        for i, e in enumerate(exs)]
    labels = lambda exs, idx: torch.tensor([exs[i].label for i in idx], dtype=torch.bool)

    # Loss aversion: the KTO paper recommends lambda_D * n_D / (lambda_U * n_U) in [1, 4/3].
    n_d = sum(e.label for e in examples)
    n_u = len(examples) - n_d
    balance = kto.desirable_weight * n_d / (kto.undesirable_weight * n_u) if n_u else math.inf
    if accelerator.is_main_process and not 1 <= balance <= 4 / 3:
        logger.warning("desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = %.3g (%d desirable, "
                       "%d undesirable) is outside [1, 4/3], the range the KTO paper recommends; adjust "
                       "--desirable_weight / --undesirable_weight", balance, n_d, n_u)

    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    costs = [2 * len(e.prompt_ids) + 2 * len(e.completion_ids) for e in examples]  # target and KL sequence
    memory = train.plan_memory(accelerator, tc, model_path, costs)
    model = models.load_policy(model_path, tc)  # with its LoRA adapter when --use_peft
    block_mask = models.uses_block_mask(model)
    per_step = tc.per_device_train_batch_size * tc.gradient_accumulation_steps * world  # examples per step
    total_steps = tc.total_steps(len(examples), per_step)
    policy = train.Trainable(accelerator, model, tc, tc.learning_rate, total_steps)

    # ---- reference log-probs of target and KL sequences: the initial policy, scored before any update ------------
    score = lambda exs, partner, desc: train.score_items(accelerator, policy.model, both(exs, partner), tc, pad,
                                                         block_mask, desc)  # (n, 2)
    needed = train.steps_indices(len(examples), range(total_steps), per_step, tc.seed)  # what the run reads
    ref_train = train.score_subset(accelerator, policy.model, both(examples, kl_train), needed, tc, pad, block_mask,
                                   "reference train")
    ref_test = score(test, kl_test, "reference test") if test else None

    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, tc, cfg.resume_checked())
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    log = MetricsLogger(accelerator, tc.output_dir, total_steps, start, flags, tc.run_name)

    def evaluate():
        logratio = score(test, kl_test, "eval") - ref_test
        z0 = algos.kl_reference_point(logratio[:, 1].sum(), torch.tensor(len(test)))
        y = labels(test, range(len(test)))
        # KTO's value sigma(beta (r - z0)) classifies a completion as desirable when its log-ratio exceeds z0.
        acc = ((logratio[:, 0] > z0) == y).float().mean().item()
        losses = algos.kto_loss(logratio[:, 0], torch.zeros(len(test)), y, z0, kto.beta, kto.desirable_weight,
                                kto.undesirable_weight)
        return {"eval/loss": losses.mean().item(), "eval/rewards/accuracy": acc, "eval/kl": z0.item(),
                "eval/rewards/desirable": kto.beta * logratio[y, 0].mean().item(),
                "eval/rewards/undesirable": kto.beta * logratio[~y, 0].mean().item()}

    if start == 0 and test:
        log.log(0, {**memory.metrics(), **evaluate()})

    def reference_point(chunks) -> tuple[torch.Tensor, dict]:
        """KL reference point z0 (KTO paper, eq. 7) of a step: the mismatched pairs of the whole step, every micro-batch
        of every rank, summed then divided by the global count, so all examples of the step share one z0. Detached
        (the paper does not backpropagate through it): these forwards keep no graph. -> (z0, the summed tally)."""
        kl = train.Tally()
        with torch.no_grad():
            for ids in chunks:
                batch = train.make_batch(sequences(examples, kl_train, ids, kl=True), tc, pad, block_mask).to(device)
                logps = train.sequence_logprobs(policy.model, batch).cpu()
                kl.add(logratio=logps - ref_train[ids, 1], pairs=len(ids), tokens=batch.num_tokens)
        kl = kl.reduce()
        return algos.kl_reference_point(torch.tensor(kl["logratio"]), torch.tensor(kl["pairs"])).float().to(device), kl

    # ---- training loop -------------------------------------------------------------------------------------------
    policy.model.train()
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        t0 = time.time()
        idx = train.step_indices(len(examples), step, per_step, tc.seed, rank, world)
        seq_len = lambda i, j: len(examples[i].prompt_ids) + len(examples[j].completion_ids)
        costs = [max(seq_len(i, i), seq_len(i, kl_train[i])) for i in idx]  # the larger of its two forwards
        tally = train.Tally()
        for attempt in policy.attempts(tc, step, idx, costs, tally):  # out of memory: redone at half the tokens
            with attempt:
                z0, kl = reference_point(attempt.chunks)
                for ids in policy.accumulate(attempt.chunks):
                    batch = train.make_batch(sequences(examples, kl_train, ids), tc, pad, block_mask).to(device)
                    y = labels(examples, ids).to(device)
                    logps = train.sequence_logprobs(policy.model, batch)
                    ref = ref_train[ids, 0].to(device)
                    losses = algos.kto_loss(logps, ref, y, z0, kto.beta, kto.desirable_weight, kto.undesirable_weight)
                    # Mean over the examples of the global step, never over a micro-batch or a class: DDP and
                    # DeepSpeed average gradients over ranks, so the rank's sum is scaled by world / per_step. A
                    # micro-batch or a rank holding one class only (or one example) then weighs exactly its share,
                    # and nothing is 0/0.
                    policy.backward(algos.global_mean_share(losses, per_step, world))
                    r = (logps - ref).detach()
                    tally.add(loss=losses.detach(), n_des=y, n_und=~y, logratio_des=r[y], logratio_und=r[~y],
                              correct=(r > z0) == y, tokens=batch.num_tokens)
                grad_norm = policy.step()
        t = tally.reduce()
        tokens = t["tokens"] + kl["tokens"]
        dt = time.time() - t0
        by_class = {}  # a class absent from the whole step has no mean: its keys are left out of the row
        for cls in ("desirable", "undesirable"):
            n, lr = t[f"n_{cls[:3]}"], t[f"logratio_{cls[:3]}"]
            if n:
                by_class.update({f"logratio/{cls}": lr / n, f"rewards/{cls}": kto.beta * lr / n})
        metrics = {"loss": t["loss"] / per_step, "kl": z0.item(), "rewards/accuracy": t["correct"] / per_step,
                   **by_class, **policy.metrics([grad_norm]), "perf/tokens_per_s": tokens / dt, "timing_s/step": dt,
                   "tokens": tokens, **sources.metrics(idx)}
        log.end_step(step + 1, metrics, tc.logging_steps, tc.eval_steps, evaluate if test else None, "loss")
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    if not stop:
        train.export_final(accelerator, policy.model, tokenizer, tc.output_dir, total_steps)
        log.close(["loss", "kl", "rewards/desirable", "rewards/undesirable", "eval/rewards/accuracy",
                   "perf/tokens_per_s"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
