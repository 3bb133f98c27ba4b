"""PPO for LLMs (Ouyang et al. 2022; Ziegler et al. 2019): actor and critic trained on DeepSpeed ZeRO-3, frozen
reference and reward models, rollouts from HF generate, GAE, clipped policy and value losses, packed token-budget
forward passes.

    python recipes/ppo.py                                   # one process, embedded tiny model and task
    python recipes/ppo.py --config recipes/configs/ppo_tiny.yaml --max_steps 40
    python recipes/ppo.py --rollout vllm                    # a vLLM engine in the process generates
    python recipes/ppo.py --rollout vllm-server            # the run starts its own server, with its own key
    VLLM_API_KEY=$(cat ~/.cache/verl_kit/vllm-serve/8000.key) python recipes/ppo.py --rollout vllm-server \
        --vllm_server_url http://127.0.0.1:8000             # after `make vllm-serve` (it prints this line)
    python recipes/ppo.py --agent examples/agents.py:calculator ...   # an OpenAI-SDK agent's episodes (docs/agents.md)
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/ppo.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/ppo.py   # or PyTorch FSDP2
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 recipes/ppo.py \
        --config recipes/configs/ppo_gpu.yaml
    make cluster-run RECIPE=recipes/ppo.py CONFIG=recipes/configs/ppo_tiny.yaml NODES=2

The embedded task: reply to the tiny dataset's prompts; a reply earns 1/4 per different kind adjective, up to four
(verl_kit.rewards:kind_reply), so learning shows as a rising reward/mean on a randomly initialised model, and no
shorter reply can win it.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import time
from dataclasses import dataclass, field
from typing import ClassVar

from verl_kit import algos, config, data, models, rewards, rollout, train
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, Timer


@dataclass
class PPOConfig(config.Config):
    """PPO's own knobs: the critic, the PPO epochs, GAE and the KL penalty in the reward; the rest of its flags are
    the online roles (config.ONLINE)."""

    CHOICES: ClassVar[dict] = {"critic_init": ("policy", "reward"), "kl_estimator": ("k1", "k3")}

    num_generations: int = field(default=2, metadata={"help": "responses sampled per prompt"})
    critic_init: str = field(default="policy", metadata={"help": "critic backbone from the policy or reward model"})
    critic_learning_rate: float = field(default=1e-3, metadata={"help": "critic AdamW learning rate"})
    num_ppo_epochs: int = field(default=2, metadata={"help": "passes over each rollout batch"})
    num_mini_batches: int = field(default=2, metadata={"help": "optimizer steps per PPO epoch"})
    cliprange_value: float = field(default=0.2, metadata={"help": "value clip around the rollout values"})
    ent_coef: float = field(default=0.0, metadata={"help": "entropy bonus coefficient"})
    gamma: float = field(default=1.0, metadata={"help": "GAE discount"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda"})
    whiten_advantages: bool = field(default=True, metadata={"help": "normalise advantages over the global batch"})
    kl_coef: float = field(default=0.05, metadata={"help": "initial KL penalty coefficient in the reward"})
    kl_estimator: str = field(default="k1", metadata={"help": "k1 or k3 per-token KL estimate in the reward"})
    adaptive_kl: bool = field(default=False, metadata={"help": "adapt kl_coef toward kl_target (Ziegler et al.)"})
    kl_target: float = field(default=6.0, metadata={"help": "target per-sequence KL of the adaptive controller"})
    kl_horizon: float = field(default=10000.0, metadata={"help": "horizon of the adaptive controller"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(1, "num_generations", "num_ppo_epochs", "num_mini_batches")

    def check_with(self, cfg: config.Args) -> None:
        if self.critic_init == "reward" and not cfg.rewards.reward_model_name_or_path:
            raise UserError("--critic_init reward needs --reward_model_name_or_path")


ARGS = {"ppo": PPOConfig, **config.ONLINE}  # the flags, by role: python recipes/ppo.py --help


@main_guard
def main():
    cfg = config.parse(**ARGS)
    ppo, flags = cfg.ppo, cfg.flags()
    accelerator = train.make_accelerator(cfg.train)
    world, device = accelerator.num_processes, accelerator.device

    # ---- data, models, rewards -----------------------------------------------------------------------------------
    model_path = models.resolve_model_path(cfg.train.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs, multi_turn=cfg.env.enabled)
    prompts, held_out = data.load_prompt_splits(cfg.train, tokenizer)
    total_steps = cfg.train.total_steps(len(prompts.ids), cfg.rollout.prompts_per_step)
    attn, checkpointing = cfg.train.attn_implementation, cfg.train.gradient_checkpointing
    critic_path = (model_path if ppo.critic_init == "policy"
                   else models.resolve_model_path(cfg.rewards.reward_model_name_or_path))
    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    reward_model = cfg.rewards.reward_model_name_or_path
    memory = train.plan_memory(accelerator, cfg.train, model_path, prompts.ids, trained_extra=(critic_path,),
                               frozen=(() if cfg.train.use_peft else (model_path,))
                               + ((models.resolve_model_path(reward_model),) if reward_model else ()),
                               rollout=cfg.rollout, vllm=cfg.vllm)
    policy = models.without_dropout(models.load_policy(model_path, cfg.train))  # see models.without_dropout
    actor = train.Trainable(accelerator, policy, cfg.train, cfg.train.learning_rate, total_steps)
    critic_model = train.CriticModel.from_pretrained(critic_path, ppo.critic_init, attn, checkpointing)
    critic_model.backbone = models.with_lora(critic_model.backbone, cfg.train, task_type=None)  # its own adapter
    critic = train.Trainable(accelerator, models.without_dropout(critic_model), cfg.train, ppo.critic_learning_rate,
                             total_steps)
    # the initial policy; with --use_peft the actor itself with its adapter disabled (no second copy of the weights)
    ref = (models.reference(actor.model) if cfg.train.use_peft
           else train.frozen(accelerator, lambda: models.load_causal_lm(model_path, attn)))
    # rollout rows -> packed (or padded) forward batches, log-probs at the sampling temperature
    packed = train.ResponsePacker(cfg.train, tokenizer.pad_token_id, actor.unwrapped(), cfg.rollout.temperature)
    kl_ctl = (algos.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon) if ppo.adaptive_kl
              else algos.FixedKLController(ppo.kl_coef))
    accelerator.register_for_checkpointing(kl_ctl)
    # reward functions and/or a frozen reward model, weighted
    reward = rewards.make_rewards(cfg.rewards, accelerator, tokenizer, cfg.train.max_length,
                                  cfg.train.per_device_eval_batch_size, cfg.env.episode_reward)
    # the --rollout backend (episodes with --environment_factory, --tools or --agent), synchronous or ahead
    rollouts = rollout.make_rollouts(accelerator, actor.unwrapped(), tokenizer, prompts, rollout=cfg.rollout,
                                     vllm=cfg.vllm, train=cfg.train, model_path=model_path, total_steps=total_steps,
                                     num_generations=ppo.num_generations, env=cfg.env)
    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, cfg.train, cfg.resume_checked(), per_rank=rollouts)
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    rollouts.load_weights(actor.unwrapped(), version=start)  # the engine samples from the (restored) actor
    log = MetricsLogger(accelerator, cfg.train.output_dir, total_steps, start, flags, cfg.train.run_name)
    correct = train.OffPolicyCorrection(cfg.ratio, cfg.rollout.backend)  # engine samples: weight by pi_old / mu

    def evaluate():  # held out: --num_generations_eval responses per prompt, same rewards, no KL term
        return rollouts.evaluate(accelerator, held_out, reward.of_rollout, cfg.rollout.prompts_per_step // world)

    if start == 0 and held_out.ids:
        log.log(0, {**memory.metrics(), **evaluate()})

    # ---- training loop -------------------------------------------------------------------------------------------
    actor.model.train()  # for gradient checkpointing (evaluation and the probe put it back after their eval mode)
    critic.model.train()
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout
        with timer("gen"):  # with --async_rollout: the wait for a batch generated during the previous update
            ro, lag = rollouts.get(step)
        mask, B = ro.response_mask, ro.response_mask.shape[0]

        # 2. rewards: sequence scores (B,), each response against its dataset row (ro.rows)
        with timer("reward"):
            scored = reward.of_rollout(ro)
            scores = scored.total
        curriculum = rollouts.observe(ro, scored)  # --curriculum: the solve rates the next draws follow

        # 3. old log-probs (the actor before this update), reference log-probs and values
        lengths = mask.sum(-1)
        costs = ro.costs  # tokens of each row's forward pass
        chunks = train.micro_batches(cfg.train, list(range(B)), costs)
        with timer("ref"):
            old_logprobs = packed.old_logprobs(actor.model, ro, chunks, device, cfg.ratio.old_logprobs)
            ref_logprobs = packed.logprobs(ref, ro, chunks, device)
        with timer("values"):
            old_values = packed.per_token(lambda b, ix: train.critic_values(critic.model, b, ix), ro, chunks, device)

        # 4. advantages: KL penalty folded into per-token rewards, GAE, whitening over the global batch
        with timer("adv"):
            kl = algos.kl_estimate(old_logprobs, ref_logprobs, ppo.kl_estimator) * mask
            token_rewards = algos.token_rewards(scores, kl, mask, kl_ctl.value)
            advantages = algos.gae(token_rewards, old_values, mask, ppo.gamma, ppo.lam)
            returns = advantages + old_values * mask
            if ppo.whiten_advantages:
                advantages = algos.whiten(advantages, mask,
                                          train.reduce_metrics(algos.masked_moments(advantages, mask)))

        # 5. PPO epochs over minibatches: actor and critic each take one optimizer step per minibatch
        tally, grad_norms = train.Tally(), {"actor": [], "critic": []}
        updates = train.updates(cfg.train, step, costs, ppo.num_ppo_epochs, ppo.num_mini_batches, (actor, critic),
                                tally)
        for update in updates:
            n_tok = train.reduce_metrics({"n": lengths[update.rows].sum()})["n"]  # minibatch tokens, all ranks
            with update:  # out of memory inside: nothing applied, the update comes again at half the tokens
                with timer("update_actor"):
                    for chunk in actor.accumulate(update.chunks):
                        logprobs, entropy, ix = packed.forward(actor.model, ro, chunk, device)
                        old, adv = ix.gather(old_logprobs, device), ix.gather(advantages, device)
                        pg, clipped = algos.clipped_surrogate(logprobs, logprobs - old, adv, cfg.ratio.cliprange,
                                                              cfg.ratio.epsilon_high)
                        pg = correct(pg, old, ro, ix, device, tally, measure=update.epoch == 0)
                        # token mean over the minibatch on all ranks (algos.reduction.global_mean_share)
                        actor.backward(algos.global_mean_share(pg - ppo.ent_coef * entropy, n_tok, world))
                        # approx_kl = mean 0.5 (log ratio)^2 (Schulman's k2); Tally detaches
                        tally.add(tokens=len(pg), pg_loss=pg, approx_kl=0.5 * (logprobs - old) ** 2,
                                  entropy=entropy, pg_clipfrac=clipped)
                    grad_norms["actor"].append(actor.step(schedule=update.last))  # the LR schedule: once per step
                with timer("update_critic"):
                    for chunk in critic.accumulate(update.chunks):
                        batch, ix = packed(ro, chunk)
                        values = train.critic_values(critic.model, batch.to(device), ix)
                        old_v, ret = ix.gather(old_values, device), ix.gather(returns, device)
                        vf, vf_clipped = algos.value_loss(values, old_v, ret, ppo.cliprange_value)
                        critic.backward(algos.global_mean_share(vf, n_tok, world))
                        tally.add(vf_loss=vf.detach(), vf_clipfrac=vf_clipped)
                    grad_norms["critic"].append(critic.step(schedule=update.last))

        # 6. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, KL controller, checkpoint ----------------------------------------------------------------
        tally.add(kl=kl, responses=B, **algos.masked_moments(returns - old_values, mask, "resid_"),
                  **algos.masked_moments(returns, mask, "ret_"))
        t = tally.reduce()
        tokens = max(t["tokens"], 1)  # 0 when every episode of the step failed: nothing was learned
        kl_mean = t["kl"] / t["responses"]
        kl_coef = kl_ctl.value
        kl_ctl.update(kl_mean, int(t["responses"]))
        timer.seconds["timing_s/step"] = time.time() - t_step
        explained = 1.0 - algos.masked_variance(t, "resid_") / max(algos.masked_variance(t, "ret_"), 1e-8)
        metrics = {"kl": kl_mean, "kl_coef": kl_coef,
                   **{f"actor/{k}": t[k] / tokens for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy")},
                   **actor.metrics(grad_norms["actor"]), "critic/nonfinite_skips": critic.nonfinite_skips,
                   "critic/vf_loss": t["vf_loss"] / tokens, "critic/vf_clipfrac": t["vf_clipfrac"] / tokens,
                   "critic/explained_var": explained,
                   "critic/grad_norm": sum(grad_norms["critic"]) / len(grad_norms["critic"]),
                   **rollout.rollout_metrics(ro, scored, timer.seconds["timing_s/step"], rollouts.environments,
                                           prompts.sources),
                   **lag, **algos.step_metrics(t), **reward.metrics(), **curriculum,
                   **timer.seconds, **sync_metrics}
        if log.end_step(step + 1, metrics, cfg.train.logging_steps, cfg.train.eval_steps,
                        evaluate if held_out.ids else None):  # a logging step: a few samples beside the metrics
            log.log_samples(rollout.sample_rows(step + 1, ro, scores, tokenizer))
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    rollouts.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    if not stop:
        train.export_final(accelerator, actor.model, tokenizer, cfg.train.output_dir, total_steps)
        log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "critic/explained_var",
                   "response_length/mean"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
