"""PPO for LLMs (Ouyang et al. 2022; Ziegler et al. 2019): actor and critic trained on DeepSpeed ZeRO-3, frozen
reference and reward models, rollouts from HF generate, GAE, clipped policy and value losses, packed token-budget
forward passes.

    python recipes/ppo.py                                   # one process, embedded tiny model and task
    python recipes/ppo.py --config recipes/configs/ppo_tiny.yaml --max_steps 40
    python recipes/ppo.py --rollout vllm                    # a vLLM engine in the process generates
    python recipes/ppo.py --rollout vllm-server --vllm_server_url http://127.0.0.1:8000   # after `make vllm-serve`
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/ppo.py
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 recipes/ppo.py \
        --config recipes/configs/ppo_gpu.yaml
    make cluster-run RECIPE=recipes/ppo.py CONFIG=recipes/configs/ppo_tiny.yaml NODES=2

The embedded task: reply to the tiny dataset's prompts; a reply earns 1/4 per different kind adjective, up to four
(verl_kit.rewards:kind_reply), so learning shows as a rising reward/mean on a randomly initialised model, and no
shorter reply can win it.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

from verl_kit.algos import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    gae,
    global_mean_share,
    kl_estimate,
    masked_moments,
    masked_variance,
    policy_clipped,
    policy_loss,
    reweight,
    step_metrics,
    token_rewards,
    value_clipped,
    value_loss,
    whiten,
)
from verl_kit.config import OnlineConfig, parse_args
from verl_kit.data import logprobs_from_logits
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, Timer
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, reference, resolve_model_path, with_lora
from verl_kit.rewards import make_rewards
from verl_kit.rollout import load_prompt_splits, rollout_metrics, sample_rows, start_rollouts
from verl_kit.train import (
    CriticModel,
    ResponsePacker,
    Tally,
    Trainable,
    actor_logits,
    critic_values,
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
class PPOConfig(OnlineConfig):
    CHOICES: ClassVar[dict] = {"critic_init": ("policy", "reward"), "kl_estimator": ("k1", "k3")}

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


@main_guard
def main():
    cfg = parse_args(PPOConfig)
    accelerator = make_accelerator(cfg)
    world, device = accelerator.num_processes, accelerator.device
    cfg.check(world)
    if cfg.critic_init == "reward" and not cfg.reward_model_name_or_path:
        raise UserError("--critic_init reward needs --reward_model_name_or_path")

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
    critic_path = model_path if cfg.critic_init == "policy" else resolve_model_path(cfg.reward_model_name_or_path)
    critic_model = CriticModel.from_pretrained(critic_path, cfg.critic_init, attn, cfg.gradient_checkpointing)
    critic_model.backbone = with_lora(critic_model.backbone, cfg, task_type=None)  # --use_peft: its own adapter
    critic = Trainable(accelerator, critic_model, cfg, cfg.critic_learning_rate, total_steps)
    # the initial policy; with --use_peft the actor itself with its adapter disabled (no second copy of the weights)
    ref = reference(actor.model) if cfg.use_peft else frozen(accelerator, lambda: load_causal_lm(model_path, attn))
    packed = ResponsePacker(cfg, pad, actor.unwrapped())  # rollout rows -> packed (or padded) forward batches
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl
              else FixedKLController(cfg.kl_coef))
    accelerator.register_for_checkpointing(kl_ctl)

    reward = make_rewards(cfg, accelerator, tokenizer)  # reward functions and/or a frozen reward model, weighted
    # the --rollout backend, synchronous or (--async_rollout) generating ahead; resumed and synced: the first step
    rollouts, start = start_rollouts(cfg, accelerator, actor.unwrapped(), model_path, tokenizer, train.ids,
                                     total_steps, rows=train.rows)  # rows: multi-turn episodes start from them
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)

    if start == 0 and test.ids:  # held out: --num_generations_eval responses per prompt, same rewards, no KL term
        log.log(0, rollouts.evaluate(accelerator, test, reward.of_rollout, cfg.prompts_per_step // world))

    # ---- training loop -------------------------------------------------------------------------------------------
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout
        with timer("gen"):  # with --async_rollout: the wait for a batch generated during the previous update
            ro, staleness = rollouts.get(step)
        mask, B = ro.response_mask, ro.response_mask.shape[0]

        # 2. rewards: sequence scores (B,)
        with timer("reward"):
            rows = [train.rows[i] for i in ro.prompt_index]  # the dataset row of each response
            scores = reward.of_rollout(rows, ro)  # sequence scores (B,)

        # 3. old log-probs (the actor before this update), reference log-probs and values
        lengths = mask.sum(-1)
        costs = ro.costs  # tokens of each row's forward pass
        chunks = micro_batches(cfg, list(range(B)), costs)
        with timer("ref"):
            old_logprobs = (ro.sampling_logprobs if cfg.old_logprobs == "rollout"
                            else packed.logprobs(actor.model, ro, chunks, device))
            ref_logprobs = packed.logprobs(ref, ro, chunks, device)
        with timer("values"):
            old_values = packed.per_token(lambda b, ix: critic_values(critic.model, b, ix), ro, chunks,
                                          device)

        # 4. advantages: KL penalty folded into per-token rewards, GAE, whitening over the global batch
        with timer("adv"):
            kl = kl_estimate(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask
            rewards = token_rewards(scores, kl, mask, kl_ctl.value)
            advantages = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
            returns = advantages + old_values * mask
            if cfg.whiten_advantages:
                advantages = whiten(advantages, mask, reduce_metrics(masked_moments(advantages, mask)))

        # 5. PPO epochs over minibatches: actor and critic each take one optimizer step per minibatch
        tally, grad_norms = Tally(), {"actor": [], "critic": []}
        for epoch in range(cfg.num_ppo_epochs):
            mbs = minibatches(B, cfg.num_mini_batches, derived_seed(cfg.seed, step, epoch))
            for j, mb in enumerate(mbs):
                last_update = epoch == cfg.num_ppo_epochs - 1 and j == len(mbs) - 1  # LR schedule: once per step
                mb_chunks = micro_batches(cfg, mb, [costs[i] for i in mb])
                n_tok = reduce_metrics({"n": lengths[mb].sum()})["n"]  # minibatch tokens, all ranks
                with timer("update_actor"):
                    for chunk in actor.accumulate(mb_chunks):
                        batch, ix = packed(ro, chunk)
                        logits = actor_logits(actor.model, batch.to(device), ix, cfg.temperature)
                        logprobs = logprobs_from_logits(logits, ix.targets.to(device))
                        old, adv = old_logprobs[ix.row, ix.pos].to(device), advantages[ix.row, ix.pos].to(device)
                        pg = policy_loss(logprobs, old, adv, cfg.cliprange, cfg.epsilon_high)
                        # the engine sampled from mu, not pi_old: importance weights (verl_kit.algos.off_policy)
                        pg = reweight(cfg, pg, old, ro.sampling_logprobs[ix.row, ix.pos].to(device),
                                      ix.row.to(device), B, tally if epoch == 0 else None)
                        entropy = entropy_from_logits(logits)
                        # token mean over the minibatch on all ranks (algos.reduction.global_mean_share)
                        actor.backward(global_mean_share(pg - cfg.ent_coef * entropy, n_tok, world))
                        with torch.no_grad():  # approx_kl = mean 0.5 (log ratio)^2 (Schulman's k2)
                            tally.add(tokens=len(pg), pg_loss=pg, pg_clipfrac=policy_clipped(logprobs, old, adv,
                                      cfg.cliprange, cfg.epsilon_high), approx_kl=0.5 * (logprobs - old) ** 2,
                                      entropy=entropy)
                    grad_norms["actor"].append(actor.step(schedule=last_update))
                with timer("update_critic"):
                    for chunk in critic.accumulate(mb_chunks):
                        batch, ix = packed(ro, chunk)
                        values = critic_values(critic.model, batch.to(device), ix)
                        old_v, ret = old_values[ix.row, ix.pos].to(device), returns[ix.row, ix.pos].to(device)
                        vf = value_loss(values, old_v, ret, cfg.cliprange_value)
                        critic.backward(global_mean_share(vf, n_tok, world))
                        tally.add(vf_loss=vf.detach(), vf_clipfrac=value_clipped(values.detach(), old_v, ret,
                                                                                 cfg.cliprange_value))
                    grad_norms["critic"].append(critic.step(schedule=last_update))

        # 6. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, KL controller, checkpoint ----------------------------------------------------------------
        tally.add(kl=kl, responses=B, **masked_moments(returns - old_values, mask, "resid_"),
                  **masked_moments(returns, mask, "ret_"))
        t = tally.reduce()
        kl_mean = t["kl"] / t["responses"]
        kl_coef = kl_ctl.value
        kl_ctl.update(kl_mean, int(t["responses"]))
        timer.seconds["timing_s/step"] = time.time() - t_step
        metrics = {"kl": kl_mean, "kl_coef": kl_coef,
                   **{f"actor/{k}": t[k] / t["tokens"] for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy")},
                   "grad_norm": sum(grad_norms["actor"]) / len(grad_norms["actor"]),
                   "critic/vf_loss": t["vf_loss"] / t["tokens"], "critic/vf_clipfrac": t["vf_clipfrac"] / t["tokens"],
                   "critic/explained_var": 1.0 - masked_variance(t, "resid_") / max(masked_variance(t, "ret_"), 1e-8),
                   "critic/grad_norm": sum(grad_norms["critic"]) / len(grad_norms["critic"]),
                   **rollout_metrics(ro, scores, timer.seconds["timing_s/step"], rollouts.environments),
                   "rollout/staleness": staleness, **step_metrics(t), **reward.metrics(),
                   "learning_rate": actor.learning_rate, **timer.seconds, **sync_metrics}
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
    log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "critic/explained_var",
               "response_length/mean"])
    destroy()


if __name__ == "__main__":
    main()
