"""DPO: Direct Preference Optimization (Rafailov et al. 2023) and its variants under TRL's `--loss_type` names (IPO,
hinge, robust, EXO, NCA, BCO, SPPO, APO, DiscoPOP, RPO's NLL term, weighted mixes, f-DPO's divergences), and the
reference-free SimPO and ORPO, on DeepSpeed ZeRO-3, with sequence packing.

    python recipes/dpo.py                                   # one process, embedded tiny model and task
    python recipes/dpo.py --config recipes/configs/dpo_tiny.yaml --learning_rate 1e-3
    python recipes/dpo.py --loss_type simpo --beta 2.0 --simpo_gamma 0.5 --cpo_alpha 0   # no reference at all
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/dpo.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/dpo.py   # or PyTorch FSDP2
    make cluster-run RECIPE=recipes/dpo.py CONFIG=recipes/configs/dpo_tiny.yaml NODES=2

The reference model is the initial policy: its log-probs are computed once, before the first update (and again on
resume, before the checkpoint is loaded), so no second model sits in memory beside the ZeRO-3 policy; with only
reference-free loss types (algos.REFERENCE_FREE_LOSS_TYPES: simpo, orpo, sft) it is not scored at all.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from verl_kit import algos, config, data, models, train
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, pair_metrics, pair_sums


@dataclass
class DPOConfig(config.Config):
    """DPO's own knobs: the loss and its temperature; the rest of its flags are config.OfflineConfig's."""

    CHOICES: ClassVar[dict] = {"f_divergence_type": algos.F_DIVERGENCES}

    beta: float = field(default=0.1, metadata={
        "help": "temperature of the implicit reward beta * log(pi / pi_ref): higher keeps the policy nearer the "
                "reference (for IPO, the inverse of the target margin)"})
    loss_type: str = field(default="sigmoid", metadata={
        "help": f"TRL's names: {', '.join(algos.DPO_LOSS_TYPES)} (docs/algorithms.md); several, comma-separated, are "
                "added with --loss_weights (TRL's MPO; sigmoid,sft is RPO)"})
    loss_weights: str | None = field(default=None, metadata={
        "help": "comma-separated weights, one per --loss_type; unset: 1 each"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "assumed fraction of flipped labels: conservative DPO (sigmoid), robust DPO (robust; < 0.5), or "
                "EXO's epsilon (exo_pair; > 0, its paper uses 1e-3)"})
    discopop_tau: float = field(default=0.05, metadata={"help": "DiscoPOP's temperature (--loss_type discopop)"})
    f_divergence_type: str = field(default="reverse_kl", metadata={
        "help": "f-DPO's divergence to the reference (TRL's): reverse_kl is DPO; the others replace each log-ratio "
                "by f'(pi/ref), for --loss_type "
                f"{', '.join(algos.F_DIVERGENCE_LOSS_TYPES)}"})
    f_alpha_divergence_coef: float = field(default=0.5, metadata={
        "help": "alpha of --f_divergence_type alpha_divergence (1: reverse_kl)"})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "SimPO's target reward margin gamma (--loss_type simpo; TRL's CPOConfig.simpo_gamma)"})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "--loss_type simpo: weight of CPO's NLL term on the chosen completion (TRL's CPOConfig.cpo_alpha and "
                "its default; 0 is the SimPO paper's loss)"})

    def __post_init__(self):
        super().__post_init__()
        if "discopop" in dict(self.losses()) and self.discopop_tau < 0.103:
            # d loss / d(beta h) at h = 0 is (1 - ln 2) / (4 tau) - 3/4: above 0 for tau < 0.1023
            config.warn(f"--loss_type discopop with --discopop_tau {self.discopop_tau} < 0.103 rises at zero margin: "
                        "a policy that starts as its reference is first pushed toward the rejected completions "
                        "(docs/algorithms.md)")

    def losses(self) -> list[tuple[str, float]]:
        """(loss type, weight) pairs from --loss_type and --loss_weights; a one-line UserError for a bad value."""
        try:
            return algos.dpo_loss_terms(self.loss_type, self.loss_weights, self.label_smoothing, self.discopop_tau,
                                        self.f_divergence_type)
        except ValueError as e:
            raise UserError(f"--{e}") from None


ARGS = {"dpo": DPOConfig, "train": config.OfflineConfig}  # the flags, by role: python recipes/dpo.py --help


def pair_loss(pol, ref, lengths, terms, cfg: DPOConfig):
    """Per-pair loss (B,) from policy and reference log-probs summed over each completion and the completions'
    lengths, all (B, 2) as (chosen, rejected): the (loss type, weight) `terms` of cfg.losses(), weighted."""
    return sum(w * algos.dpo_loss(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], cfg.beta, loss_type, cfg.label_smoothing,
                                  lengths[:, 0], lengths[:, 1], cfg.discopop_tau, cfg.f_divergence_type,
                                  cfg.f_alpha_divergence_coef, cfg.simpo_gamma, cfg.cpo_alpha)
               for loss_type, w in terms)


@main_guard
def main():
    cfg = config.parse(**ARGS)
    dpo, tc, flags = cfg.dpo, cfg.train, cfg.flags()
    accelerator = train.make_accelerator(tc)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    terms = dpo.losses()  # (--loss_type, weight) pairs

    # ---- data and models -----------------------------------------------------------------------------------------
    model_path = models.resolve_model_path(tc.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs)
    pad = tokenizer.pad_token_id
    train_ds, test_ds = data.load_splits(tc)
    pairs = data.preference_examples(train_ds, tokenizer, tc.max_prompt_length, tc.max_length, tc.train_source)
    sources = data.row_sources(train_ds, len(pairs))  # data/source_share/* of a mixture's steps
    test = data.preference_examples(test_ds, tokenizer, tc.max_prompt_length, tc.max_length,
                                    tc.test_source) if test_ds else []
    items = lambda exs: [train.completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    lengths = lambda exs: torch.tensor([[len(e.chosen_ids), len(e.rejected_ids)] for e in exs], dtype=torch.float32)

    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    memory = train.plan_memory(accelerator, tc, model_path, [e.cost for e in pairs])
    model = models.load_policy(model_path, tc)  # with its LoRA adapter when --use_peft
    block_mask = models.uses_block_mask(model)
    per_step = tc.per_device_train_batch_size * tc.gradient_accumulation_steps * world  # pairs per optimizer step
    total_steps = tc.total_steps(len(pairs), per_step)
    policy = train.Trainable(accelerator, model, tc, tc.learning_rate, total_steps)

    # ---- reference log-probs: the initial policy, scored before any update, for the pairs the run will read -------
    # (the pairs of every step from 0, also on resume: scored in the same batches, they are bit-identical)
    # reference-free losses (SimPO, ORPO) read none: zeros, so the implicit rewards logged are beta * log pi
    needed = train.steps_indices(len(pairs), range(total_steps), per_step, tc.seed)
    free = all(t in algos.REFERENCE_FREE_LOSS_TYPES for t, _ in terms)
    ref_train = torch.zeros(len(pairs), 2) if free else train.score_subset(
        accelerator, policy.model, items(pairs), needed, tc, pad, block_mask, "reference train")
    ref_test = torch.zeros(len(test), 2) if free else (
        train.score_items(accelerator, policy.model, items(test), tc, pad, block_mask, "reference test") if test
        else None)

    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, tc, cfg.resume_checked())
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    log = MetricsLogger(accelerator, tc.output_dir, total_steps, start, flags, tc.run_name)

    def evaluate():
        logps = train.score_items(accelerator, policy.model, items(test), tc, pad, block_mask, "eval")
        rewards = algos.implicit_rewards(logps, ref_test, dpo.beta)
        acc = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
        loss = pair_loss(logps, ref_test, lengths(test), terms, dpo)
        return {"eval/loss": loss.mean().item(), "eval/rewards/accuracy": acc,
                "eval/rewards/margin": (rewards[:, 0] - rewards[:, 1]).mean().item()}

    if start == 0:
        log.log(0, {**policy.size_metrics(), **memory.metrics(), "pairs/train": len(pairs), "pairs/test": len(test),
                    **(evaluate() if test else {})})

    # ---- training loop -------------------------------------------------------------------------------------------
    policy.model.train()
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        t0 = time.time()
        idx = train.step_indices(len(pairs), step, per_step, tc.seed, rank, world)
        costs = [pairs[i].cost for i in idx]
        tally = train.Tally()
        for attempt in policy.attempts(tc, step, idx, costs, tally):  # out of memory: redone at half the tokens
            with attempt:
                for chunk in policy.accumulate(attempt.chunks):
                    exs = [pairs[i] for i in chunk]
                    batch = train.make_batch(items(exs), tc, pad, block_mask).to(device)
                    logps = train.sequence_logprobs(policy.model, batch).view(-1, 2)
                    ref = ref_train[chunk].to(device)
                    losses = pair_loss(logps, ref, lengths(exs).to(device), terms, dpo)
                    # Mean over the pairs of the global step. DDP and DeepSpeed average gradients over ranks, so the
                    # rank's sum is scaled by world / per_step; the result does not depend on how pairs are split.
                    policy.backward(algos.global_mean_share(losses, per_step, world))
                    tally.add(**pair_sums(losses, algos.implicit_rewards(logps, ref, dpo.beta)),
                              tokens=batch.num_tokens)
                grad_norm = policy.step()
        t = tally.reduce()
        dt = time.time() - t0
        metrics = {**pair_metrics(t, per_step), **policy.metrics([grad_norm]), "perf/tokens_per_s": t["tokens"] / dt,
                   "timing_s/step": dt, "tokens": t["tokens"], **sources.metrics(idx)}
        log.end_step(step + 1, metrics, tc.logging_steps, tc.eval_steps, evaluate if test else None, "loss")
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    if not stop:
        train.export_final(accelerator, policy.model, tokenizer, tc.output_dir, total_steps)
        log.close(["loss", "rewards/accuracy", "rewards/margin", "eval/rewards/accuracy", "perf/tokens_per_s"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
