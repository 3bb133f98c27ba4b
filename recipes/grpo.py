"""GRPO for LLMs (Shao et al. 2024, DeepSeekMath): several responses per prompt, each scored; a response's advantage is
its score against its group's mean and standard deviation; clipped policy loss with a KL(policy || reference)
penalty in the loss; no critic. Rollouts from HF generate or vLLM, packed token-budget forward passes, ZeRO-3.
Its variants (docs/algorithms.md): RLOO and REINFORCE++-baseline advantages (--advantage_estimator), clip-higher
(--epsilon_high), GSPO (--importance_sampling_level sequence), CISPO (--loss_type cispo), truncated responses out of
the loss (--mask_truncated_completions), DAPO's dynamic sampling (--dynamic_sampling).

    python recipes/grpo.py                                  # one process, embedded tiny model and task
    python recipes/grpo.py --config recipes/configs/grpo_tiny.yaml
    python recipes/grpo.py --config recipes/configs/grpo_tiny.yaml --advantage_estimator rloo
    python recipes/grpo.py --rollout vllm                   # a vLLM engine in the process generates
    python recipes/grpo.py --rollout vllm --async_rollout   # ... the next batch while the trainer updates
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/grpo.py
    make cluster-run RECIPE=recipes/grpo.py CONFIG=recipes/configs/grpo_tiny.yaml NODES=2

The embedded task is PPO's (recipes/ppo.py): 1/4 per different kind adjective in the reply, up to four.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

from verl_kit.algos import (
    cispo_clipped,
    cispo_loss,
    clipped_surrogate,
    entropy_from_logits,
    global_mean_share,
    group_advantages,
    kl_estimate,
    loss_weights,
    reinforce_plus_plus_baseline_advantages,
    reweight,
    rloo_advantages,
    sequence_log_ratio,
    step_metrics,
    surrogate_clipped,
)
from verl_kit.config import OnlineConfig, parse_args
from verl_kit.data import logprobs_from_logits
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, Timer, logger
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, reference, resolve_model_path, with_lora
from verl_kit.rewards import make_rewards
from verl_kit.rollout import dynamic_sampling, load_prompt_splits, rollout_metrics, sample_rows, start_rollouts
from verl_kit.train import (
    ResponsePacker,
    Tally,
    Trainable,
    actor_logits,
    derived_seed,
    destroy,
    frozen,
    make_accelerator,
    micro_batches,
    minibatches,
    reduce_metrics,
    save_if_due,
)


@dataclass
class GRPOConfig(OnlineConfig):
    CHOICES: ClassVar[dict] = {"loss_type": ("dapo", "grpo", "dr_grpo", "cispo"),
                               "advantage_estimator": ("grpo", "rloo", "reinforce_plus_plus_baseline"),
                               "importance_sampling_level": ("token", "sequence")}

    num_generations: int = field(default=4, metadata={"help": "responses sampled per prompt (the group), >= 2"})
    advantage_estimator: str = field(default="grpo", metadata={
        "help": "grpo (score minus the group mean, over the group std), rloo (minus the mean of the other responses "
                "of the group) or reinforce_plus_plus_baseline (minus the group mean, whitened over the batch); "
                "verl's names"})
    scale_rewards: bool = field(default=True, metadata={
        "help": "--advantage_estimator grpo: divide advantages by the group's std (false: Dr. GRPO, centring only)"})
    beta: float = field(default=0.04, metadata={
        "help": "coefficient of the KL(policy || reference) penalty in the loss (k3 estimator, per token); 0 loads "
                "no reference model"})
    num_iterations: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    num_mini_batches: int = field(default=1, metadata={"help": "optimizer steps per pass"})
    loss_type: str = field(default="dapo", metadata={
        "help": "TRL's names: the clipped loss reduced as dapo (mean over all tokens of the minibatch), grpo (mean "
                "of per-response token means) or dr_grpo (sum over tokens / (responses x max_completion_length)); "
                "or cispo (CISPO: the importance weight capped at --epsilon_high and detached, times log-prob and "
                "advantage; reduced as dapo)"})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "token (PPO's per-token ratio) or sequence (GSPO: the mean log-ratio of the response on each of "
                "its tokens); TRL's flag"})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "responses cut at --max_completion_length (no EOS) add nothing to the loss and are not counted "
                "in its token or response totals (DAPO); their scores still enter the advantages"})
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO's dynamic sampling: groups whose scores are all equal are dropped and more batches generated "
                "until the step holds --prompts_per_step informative groups (verl's algorithm.filter_groups.enable)"})
    max_num_gen_batches: int = field(default=10, metadata={
        "help": "--dynamic_sampling: generation batches per step at most, the first included; then the step trains "
                "on the informative groups it found, with a warning (verl's filter_groups.max_num_gen_batches)"})


@main_guard
def main():
    cfg = parse_args(GRPOConfig)
    if cfg.num_generations < 2:
        raise UserError(f"--num_generations {cfg.num_generations}: GRPO compares responses within a group, use >= 2")
    if cfg.loss_type == "cispo" and (cfg.epsilon_high is None or cfg.epsilon_high < 1.0):
        raise UserError(f"--loss_type cispo needs --epsilon_high >= 1 (the cap of the importance weight; ScaleRL "
                        f"uses 5.0), got {cfg.epsilon_high}")
    if cfg.max_num_gen_batches < 1:
        raise UserError(f"--max_num_gen_batches {cfg.max_num_gen_batches}: use >= 1 (the step's own batch counts)")
    if cfg.mask_truncated_completions and cfg.ignore_eos:
        raise UserError("--mask_truncated_completions with --ignore_eos would mask every response (none ends in EOS)")
    accelerator = make_accelerator(cfg)
    world, device = accelerator.num_processes, accelerator.device
    cfg.check(world)
    one_update = cfg.num_iterations * cfg.num_mini_batches == 1  # then old log-probs = this forward's, detached
    if one_update and cfg.old_logprobs != "recompute" and accelerator.is_main_process:
        logger.warning("--old_logprobs %s has no effect: with one update per rollout (--num_iterations 1 "
                       "--num_mini_batches 1) the policy ratio is taken against the update's own forward",
                       cfg.old_logprobs)
    if not cfg.scale_rewards and cfg.advantage_estimator != "grpo" and accelerator.is_main_process:
        logger.warning("--scale_rewards false has no effect with --advantage_estimator %s", cfg.advantage_estimator)

    # ---- data, models, rewards -----------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    train, test = load_prompt_splits(cfg, tokenizer)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train.ids)
                                                                      / cfg.prompts_per_step)
    attn = cfg.attn_implementation
    actor = Trainable(accelerator, with_lora(load_causal_lm(model_path, attn, cfg.gradient_checkpointing), cfg), cfg,
                      cfg.learning_rate, total_steps)
    # the initial policy; with --use_peft the actor itself with its adapter disabled (no second copy of the weights)
    ref = None if cfg.beta == 0 else reference(actor.model) if cfg.use_peft else \
        frozen(accelerator, lambda: load_causal_lm(model_path, attn))
    packed = ResponsePacker(cfg, pad, actor.unwrapped())  # rollout rows -> packed (or padded) forward batches
    reward = make_rewards(cfg, accelerator, tokenizer)  # reward functions and/or a frozen reward model, weighted
    # the --rollout backend, synchronous or (--async_rollout) generating ahead; resumed and synced: the first step
    rollouts, start = start_rollouts(cfg, accelerator, actor.unwrapped(), model_path, tokenizer, train.ids,
                                     total_steps, rows=train.rows)  # rows: multi-turn episodes start from them
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)

    def score(ro):  # sequence scores (B,) of a rollout's responses, each against its dataset row
        return reward.of_rollout([train.rows[i] for i in ro.prompt_index], ro)

    if start == 0 and test.ids:  # held out: --num_generations_eval responses per prompt, same rewards, no KL term
        log.log(0, rollouts.evaluate(accelerator, test, reward.of_rollout, cfg.prompts_per_step // world))

    # ---- training loop -------------------------------------------------------------------------------------------
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout: num_generations responses per prompt, a prompt's group on one process
        with timer("gen"):  # with --async_rollout: the wait for a batch generated during the previous update
            ro, staleness = rollouts.get(step)

        # 2. rewards and group-relative advantages (B,)
        with timer("reward"):
            scores = score(ro)
        sampled = {}  # --dynamic_sampling (DAPO): flat groups dropped, further batches generated to fill the step
        if cfg.dynamic_sampling:
            with timer("dynamic_sampling"):
                ro, scores, sampled = dynamic_sampling(rollouts, step, ro, scores, score, cfg.num_generations,
                                                       cfg.max_num_gen_batches)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        rows = [train.rows[i] for i in ro.prompt_index]  # the dataset row of each response
        with timer("reward"):
            if cfg.advantage_estimator == "rloo":
                advantages = rloo_advantages(scores, cfg.num_generations)
            elif cfg.advantage_estimator == "reinforce_plus_plus_baseline":  # whitened over all ranks' tokens
                advantages = reinforce_plus_plus_baseline_advantages(scores, cfg.num_generations, mask, reduce_metrics)
            else:
                advantages = group_advantages(scores, cfg.num_generations, cfg.scale_rewards)

        # 3. reference log-probs (for the KL term) and, with several updates per rollout, the old log-probs
        lengths = mask.sum(-1)
        # --mask_truncated_completions: responses without EOS weigh 0 and leave the loss's token/response counts
        keep = ~ro.truncated if cfg.mask_truncated_completions else torch.ones(B, dtype=torch.bool)
        costs = ro.costs  # tokens of each row's forward pass
        with timer("ref"):
            chunks = micro_batches(cfg, list(range(B)), costs)
            ref_logprobs = packed.logprobs(ref, ro, chunks, device) if ref is not None else None
            old_logprobs = None if one_update else (
                ro.sampling_logprobs if cfg.old_logprobs == "rollout"
                else packed.logprobs(actor.model, ro, chunks, device))

        # 4. updates: num_iterations passes over the batch, num_mini_batches optimizer steps each
        tally, grad_norms = Tally(), []
        for it in range(cfg.num_iterations):
            mbs = minibatches(B, cfg.num_mini_batches, derived_seed(cfg.seed, step, it))
            for j, mb in enumerate(mbs):
                mb_chunks = micro_batches(cfg, mb, [costs[i] for i in mb])
                n = reduce_metrics({"tokens": lengths[mb][keep[mb]].sum(), "seqs": keep[mb].sum()})  # all ranks
                with timer("update_actor"):
                    for chunk in actor.accumulate(mb_chunks):
                        batch, ix = packed(ro, chunk)
                        logits = actor_logits(actor.model, batch.to(device), ix, cfg.temperature)
                        logprobs = logprobs_from_logits(logits, ix.targets.to(device))
                        old = logprobs.detach() if one_update else old_logprobs[ix.row, ix.pos].to(device)
                        adv = advantages[ix.row].to(device)  # a response's advantage on each of its tokens
                        # ratio per token, or GSPO's per response (the tokens of a response are all in this chunk)
                        log_ratio = (sequence_log_ratio(logprobs, old, ix.row.to(device), B)
                                     if cfg.importance_sampling_level == "sequence" else logprobs - old)
                        if cfg.loss_type == "cispo":
                            loss = cispo_loss(logprobs, log_ratio, adv, cfg.epsilon_high)
                            clipped = cispo_clipped(log_ratio, adv, cfg.epsilon_high)
                        else:
                            loss = clipped_surrogate(log_ratio, adv, cfg.cliprange, cfg.epsilon_high)
                            clipped = surrogate_clipped(log_ratio, adv, cfg.cliprange, cfg.epsilon_high)
                        # the engine sampled from mu, not pi_old: importance weights (verl_kit.algos.off_policy)
                        loss = reweight(cfg, loss, old, ro.sampling_logprobs[ix.row, ix.pos].to(device),
                                        ix.row.to(device), B, tally if it == 0 else None)
                        kl = (kl_estimate(logprobs, ref_logprobs[ix.row, ix.pos].to(device), "k3") if ref is not None
                              else torch.zeros_like(logprobs))
                        # this micro-batch's share of the minibatch loss on all ranks (algos.reduction.loss_weights)
                        w = loss_weights(cfg.loss_type, lengths[ix.row], max(n["tokens"], 1), max(n["seqs"], 1),
                                         cfg.max_completion_length) * keep[ix.row]
                        actor.backward(global_mean_share((loss + cfg.beta * kl) * w.to(device), 1.0, world))
                        with torch.no_grad():
                            tally.add(tokens=len(loss), pg_loss=loss, pg_clipfrac=clipped,
                                      approx_kl=0.5 * (logprobs - old) ** 2, entropy=entropy_from_logits(logits), kl=kl)
                    last_update = it == cfg.num_iterations - 1 and j == len(mbs) - 1  # LR schedule: once per step
                    grad_norms.append(actor.step(schedule=last_update))

        # 5. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, checkpoint -------------------------------------------------------------------------------
        tally.add(flat_groups=scores.view(-1, cfg.num_generations).std(-1) == 0, groups=B / cfg.num_generations)
        t = tally.reduce()
        timer.seconds["timing_s/step"] = time.time() - t_step
        metrics = {**rollout_metrics(ro, scores, timer.seconds["timing_s/step"], rollouts.environments),
                   "reward/frac_zero_std": t["flat_groups"] / t["groups"],
                   "kl": t["kl"] / t["tokens"],
                   **{f"actor/{k}": t[k] / t["tokens"] for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy")},
                   "grad_norm": sum(grad_norms) / len(grad_norms), "learning_rate": actor.learning_rate,
                   "rollout/staleness": staleness, **step_metrics(t), **reward.metrics(), **sampled,
                   **timer.seconds, **sync_metrics}
        log.advance(reward=metrics["reward/mean"])
        do_eval = test.ids and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps)
        if do_eval:
            metrics.update(rollouts.evaluate(accelerator, test, reward.of_rollout, cfg.prompts_per_step // world))
        if (step + 1) % cfg.logging_steps == 0 or step == start or step + 1 == total_steps or do_eval:
            log.log(step + 1, metrics)
            log.log_samples(sample_rows(step + 1, rows, ro, scores, tokenizer))
        save_if_due(accelerator, cfg, step + 1, per_rank=rollouts)

    rollouts.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    export_hf(accelerator, actor.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "response_length/mean"])
    destroy()


if __name__ == "__main__":
    main()
