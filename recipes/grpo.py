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
    python recipes/grpo.py --config recipes/configs/grpo_calc_agent.yaml   # an OpenAI-SDK agent (docs/agents.md)
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/grpo.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/grpo.py   # or PyTorch FSDP2
    make cluster-run RECIPE=recipes/grpo.py CONFIG=recipes/configs/grpo_tiny.yaml NODES=2

The embedded task is PPO's (recipes/ppo.py): 1/4 per different kind adjective in the reply, up to four.
Variants: a change of the loss or the advantage that keeps this loop is a flag here (as TRL's GRPOConfig); one that
changes the loop (another model, another data flow: PPO's critic, distillation's teacher) is its own recipe file.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from verl_kit import algos, config, data, models, rewards, rollout, train
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, Timer


@dataclass
class GRPOConfig(config.Config):
    """GRPO's own knobs; the rest of its flags are the online roles (config.ONLINE)."""

    CHOICES: ClassVar[dict] = {"loss_type": tuple(algos.POLICY_LOSSES),
                               "advantage_estimator": algos.OUTCOME_ESTIMATORS,
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
        "help": "TRL's names, each a surrogate loss and the reduction it implies, declared in algos.POLICY_LOSSES "
                "(docs/algorithms.md): the clipped loss as a token mean (dapo), a mean of response means (grpo) or a "
                "constant normaliser (dr_grpo); cispo: CISPO's capped, detached weight (--epsilon_high)"})
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

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise UserError(f"--num_generations {self.num_generations}: GRPO compares responses within a group, use "
                            ">= 2")
        self.at_least(1, "num_iterations", "num_mini_batches", "max_num_gen_batches")
        if not self.scale_rewards and self.advantage_estimator != "grpo":
            config.warn(f"--scale_rewards false has no effect with --advantage_estimator {self.advantage_estimator}")

    def check_with(self, cfg: config.Args) -> None:
        if self.loss_type == "cispo" and (cfg.ratio.epsilon_high is None or cfg.ratio.epsilon_high < 1.0):
            raise UserError(f"--loss_type cispo needs --epsilon_high >= 1 (the cap of the importance weight; ScaleRL "
                            f"uses 5.0), got {cfg.ratio.epsilon_high}")
        if self.mask_truncated_completions and cfg.rollout.ignore_eos:
            raise UserError("--mask_truncated_completions with --ignore_eos would mask every response (none ends in "
                            "EOS)")
        if self.one_update and cfg.ratio.old_logprobs != "recompute":
            config.warn(f"--old_logprobs {cfg.ratio.old_logprobs} has no effect: with one update per rollout "
                        "(--num_iterations 1 --num_mini_batches 1) the policy ratio is taken against the update's "
                        "own forward")

    @property
    def one_update(self) -> bool:
        """One optimizer step per rollout: the old log-probs are the update's own forward, detached."""
        return self.num_iterations * self.num_mini_batches == 1


ARGS = {"grpo": GRPOConfig, **config.ONLINE, "entropy": config.EntropyConfig}  # python recipes/grpo.py --help


@main_guard
def main():
    cfg = config.parse(**ARGS)
    grpo, flags = cfg.grpo, cfg.flags()
    accelerator = train.make_accelerator(cfg.train)
    world, device = accelerator.num_processes, accelerator.device

    # ---- data, models, rewards -----------------------------------------------------------------------------------
    model_path = models.resolve_model_path(cfg.train.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs, multi_turn=cfg.env.enabled)
    prompts, held_out = data.load_prompt_splits(cfg.train, tokenizer)
    total_steps = cfg.train.total_steps(len(prompts.ids), cfg.rollout.prompts_per_step)
    attn = cfg.train.attn_implementation
    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    memory = train.plan_memory(accelerator, cfg.train, model_path, prompts.ids,
                               frozen=(model_path,) if grpo.beta and not cfg.train.use_peft else (),
                               rollout=cfg.rollout, vllm=cfg.vllm, generations=grpo.num_generations)
    policy = models.without_dropout(models.load_policy(model_path, cfg.train))  # see models.without_dropout
    actor = train.Trainable(accelerator, policy, cfg.train, cfg.train.learning_rate, total_steps)
    # the initial policy; with --use_peft the actor itself with its adapter disabled (no second copy of the weights)
    ref = None if grpo.beta == 0 else models.reference(actor.model) if cfg.train.use_peft else \
        train.frozen(accelerator, lambda: models.load_causal_lm(model_path, attn))
    # rollout rows -> packed (or padded) forward batches, log-probs at the sampling temperature
    packed = train.ResponsePacker(cfg.train, tokenizer.pad_token_id, actor.unwrapped(), cfg.rollout.temperature)
    # reward functions and/or a frozen reward model, weighted
    reward = rewards.make_rewards(cfg.rewards, accelerator, tokenizer, cfg.train.max_length,
                                  cfg.train.per_device_eval_batch_size, cfg.env.episode_reward)
    ent = train.EntropyTerms(cfg.entropy, accelerator)  # TRL's entropy controls (off by default), checkpointed
    # the --rollout backend (episodes with --environment_factory, --tools or --agent), synchronous or ahead
    rollouts = rollout.make_rollouts(accelerator, actor.unwrapped(), tokenizer, prompts, rollout=cfg.rollout,
                                     vllm=cfg.vllm, train=cfg.train, model_path=model_path, total_steps=total_steps,
                                     num_generations=grpo.num_generations, env=cfg.env)
    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, cfg.train, cfg.resume_checked(), per_rank=rollouts)
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    rollouts.load_weights(actor.unwrapped(), version=start)  # the engine samples from the (restored) actor
    log = MetricsLogger(accelerator, cfg.train.output_dir, total_steps, start, flags, cfg.train.run_name)
    # the loss: TRL's --loss_type names a surrogate and the reduction it implies (algos.policy.POLICY_LOSSES)
    policy_loss = algos.POLICY_LOSSES[grpo.loss_type]
    correct = train.OffPolicyCorrection(cfg.ratio, cfg.rollout.backend)  # engine samples: weight by pi_old / mu

    def evaluate():  # held out: --num_generations_eval responses per prompt, same rewards, no KL term
        return rollouts.evaluate(accelerator, held_out, reward.of_rollout, cfg.rollout.prompts_per_step // world)

    if start == 0 and held_out.ids:
        log.log(0, {**memory.metrics(), **evaluate()})

    # ---- training loop -------------------------------------------------------------------------------------------
    actor.model.train()  # for gradient checkpointing (evaluation and the probe put it back after their eval mode)
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout: num_generations responses per prompt, a prompt's group on one process
        with timer("gen"):  # with --async_rollout: the wait for a batch generated during the previous update
            ro, lag = rollouts.get(step)

        # 2. rewards (each response against its dataset row, ro.rows) and group-relative advantages (B,)
        with timer("reward"):
            scored = reward.of_rollout(ro)
        curriculum = rollouts.observe(ro, scored)  # --curriculum: the solve rates the next draws follow
        sampled = {}  # --dynamic_sampling (DAPO): flat groups dropped, further batches generated to fill the step
        if grpo.dynamic_sampling:
            with timer("dynamic_sampling"):
                ro, scored, sampled = rollout.dynamic_sampling(rollouts, step, ro, scored, reward.of_rollout,
                                                               grpo.num_generations, grpo.max_num_gen_batches)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        # one score per episode (E,), advantages back on its rows (B,): a row each, unless an --agent's calls did not
        # extend each other (per-call samples, docs/agents.md): its rows then share the episode's advantage
        scores = ro.per_episode(scored.total)
        with timer("reward"):  # --advantage_estimator's (REINFORCE++-baseline whitens over all ranks' tokens)
            advantages = algos.outcome_advantages(grpo.advantage_estimator, scores, grpo.num_generations, mask,
                                                  ro.row_episode(), grpo.scale_rewards, train.reduce_metrics)

        # 3. reference log-probs (for the KL term) and, with several updates per rollout, the old log-probs
        lengths = mask.sum(-1)
        # --mask_truncated_completions: responses without EOS weigh 0 and leave the loss's token/response counts
        keep = ~ro.truncated if grpo.mask_truncated_completions else torch.ones(B, dtype=torch.bool)
        costs = ro.costs  # tokens of each row's forward pass
        with timer("ref"):
            chunks = train.micro_batches(cfg.train, list(range(B)), costs)
            ref_logprobs = packed.logprobs(ref, ro, chunks, device) if ref is not None else None
            old_logprobs = None if grpo.one_update else packed.old_logprobs(actor.model, ro, chunks, device,
                                                                            cfg.ratio.old_logprobs)

        # 4. updates: num_iterations passes over the batch, num_mini_batches optimizer steps each
        tally, grad_norms = train.Tally(), []
        updates = train.updates(cfg.train, step, costs, grpo.num_iterations, grpo.num_mini_batches,
                                (actor,), tally)
        for update in timer.each("update_actor", updates):
            mb = update.rows
            n = train.reduce_metrics({"tokens": lengths[mb][keep[mb]].sum(), "seqs": keep[mb].sum()})  # all ranks
            with update:  # out of memory inside: nothing applied, the update comes again at half the tokens
                ent.start()  # --entropy_coef and friends: this optimizer step's coefficient
                for chunk in actor.accumulate(update.chunks):
                    logprobs, entropy, ix = packed.forward(actor.model, ro, chunk, device)
                    old = logprobs.detach() if grpo.one_update else ix.gather(old_logprobs, device)
                    adv, row = ix.gather(advantages, device), ix.row.to(device)  # a response's advantage per token
                    # ratio per token, or GSPO's per response (the tokens of a response are all in this chunk)
                    log_ratio = (algos.sequence_log_ratio(logprobs, old, row, B)
                                 if grpo.importance_sampling_level == "sequence" else logprobs - old)
                    loss, clipped = policy_loss.surrogate(logprobs, log_ratio, adv, cfg.ratio.cliprange,
                                                          cfg.ratio.epsilon_high)
                    loss = correct(loss, old, ro, ix, device, tally, measure=update.epoch == 0)
                    acting, bonus = ent.terms(entropy, ix.gather(keep).to(device), n["tokens"], len(update.chunks))
                    if acting is not None:  # --top_entropy_quantile: the policy term on the high-entropy tokens only
                        loss = loss * acting
                    kl = (algos.kl_estimate(logprobs, ix.gather(ref_logprobs, device), "k3") if ref is not None
                          else torch.zeros_like(logprobs))
                    # this micro-batch's share of the minibatch loss on all ranks (algos.reduction.loss_weights)
                    w = algos.loss_weights(policy_loss.reduction, ix.gather(lengths), max(n["tokens"], 1),
                                           max(n["seqs"], 1), cfg.rollout.max_completion_length) * ix.gather(keep)
                    objective = (loss + grpo.beta * kl) * w.to(device)
                    objective = objective if bonus is None else objective + bonus
                    actor.backward(algos.global_mean_share(objective, 1.0, world))
                    tally.add(tokens=len(loss), pg_loss=loss, pg_clipfrac=clipped,  # Tally detaches
                              approx_kl=0.5 * (logprobs - old) ** 2, entropy=entropy, kl=kl)
                grad_norms.append(actor.step(schedule=update.last))  # the LR schedule advances once per step
            entropy_metrics = ent.end()  # --use_adaptive_entropy: the coefficient moves

        # 5. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, checkpoint -------------------------------------------------------------------------------
        tally.add(flat_groups=scores.view(-1, grpo.num_generations).std(-1) == 0,
                  groups=len(scores) / grpo.num_generations)
        t = tally.reduce()
        tokens = max(t["tokens"], 1)  # 0 when every episode of the step failed: nothing was learned
        timer.seconds["timing_s/step"] = time.time() - t_step
        metrics = {**rollout.rollout_metrics(ro, scored, timer.seconds["timing_s/step"], rollouts.environments,
                                                 prompts.sources),
                   "reward/frac_zero_std": t["flat_groups"] / t["groups"], "kl": t["kl"] / tokens,
                   **{f"actor/{k}": t[k] / tokens for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy")},
                   **actor.metrics(grad_norms), **lag, **algos.step_metrics(t),
                   **reward.metrics(), **sampled, **curriculum, **timer.seconds, **sync_metrics,
                   **entropy_metrics}
        if log.end_step(step + 1, metrics, cfg.train.logging_steps, cfg.train.eval_steps,
                        evaluate if held_out.ids else None):  # a logging step: a few samples beside the metrics
            log.log_samples(rollout.sample_rows(step + 1, ro, scored.total, tokenizer))
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    rollouts.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    if not stop:
        train.export_final(accelerator, actor.model, tokenizer, cfg.train.output_dir, total_steps)
        log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "response_length/mean"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
