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

The embedded task: reply to the tiny dataset's prompts; the reward is the share of words that are kind adjectives
(verl_kit.rewards:kind_words), so learning shows as a rising reward/mean on a randomly initialised model.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from verl_kit.actor_critic import CriticModel, Trainable, actor_logits, critic_values, frozen, pack_responses
from verl_kit.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    kl_estimate,
    masked_moments,
    token_rewards,
    whiten,
)
from verl_kit.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from verl_kit.config import parse_args
from verl_kit.data import load_split
from verl_kit.distributed import (
    all_reduce_max,
    all_reduce_sum,
    destroy,
    lockstep_micro_batches,
    make_accelerator,
    step_indices,
)
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, check_writable, setup_logging
from verl_kit.models import export_hf, load_causal_lm, load_tokenizer, resolve_model_path, uses_block_mask
from verl_kit.ppo_losses import (
    entropy_from_logits,
    logprobs_from_logits,
    policy_clipped,
    policy_loss,
    token_mean_share,
    value_clipped,
    value_loss,
)
from verl_kit.rewards import Rewards, load_reward_model
from verl_kit.rollout import evaluate, load_prompts
from verl_kit.vllm_rollout import OnlineConfig, rollout_backend

logger = logging.getLogger("verl_kit")


@dataclass
class PPOConfig(OnlineConfig):
    critic_init: str = field(default="policy", metadata={"help": "critic backbone from the policy or reward model"})
    critic_learning_rate: float = field(default=1e-3, metadata={"help": "critic AdamW learning rate"})
    num_ppo_epochs: int = field(default=2, metadata={"help": "passes over each rollout batch"})
    num_mini_batches: int = field(default=2, metadata={"help": "optimizer steps per PPO epoch"})
    cliprange: float = field(default=0.2, metadata={"help": "policy ratio clip epsilon"})
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
    for name, value, allowed in [("critic_init", cfg.critic_init, ("policy", "reward")),
                                 ("kl_estimator", cfg.kl_estimator, ("k1", "k3"))]:
        if value not in allowed:
            raise UserError(f"--{name}: {value!r} is not one of {', '.join(allowed)}")
    accelerator = make_accelerator(cfg)
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    cfg.check(world)
    if cfg.critic_init == "reward" and not cfg.reward_model_name_or_path:
        raise UserError("--critic_init reward needs --reward_model_name_or_path")

    # ---- data, models, rewards -----------------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id
    rows = list(load_split(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config))
    prompts = load_prompts(rows, tokenizer, cfg.max_prompt_length, cfg.dataset_name)
    test_ds = cfg.dataset_test_split and load_split(cfg.dataset_name, cfg.dataset_test_split, cfg.dataset_config,
                                                    required=False)
    test_rows = list(test_ds) if test_ds else []
    test_prompts = load_prompts(test_rows, tokenizer, cfg.max_prompt_length, cfg.dataset_name)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(rows)
                                                                      / cfg.prompts_per_step)
    attn = cfg.attn_implementation
    schedule = dict(weight_decay=cfg.weight_decay, scheduler_type=cfg.lr_scheduler_type, total_steps=total_steps,
                    warmup_steps=int(cfg.warmup_ratio * total_steps), max_grad_norm=cfg.max_grad_norm)
    actor = Trainable(accelerator, load_causal_lm(model_path, attn, cfg.gradient_checkpointing), cfg.learning_rate,
                      **schedule)
    critic_path = model_path if cfg.critic_init == "policy" else resolve_model_path(cfg.reward_model_name_or_path)
    critic = Trainable(accelerator, CriticModel.from_pretrained(critic_path, cfg.critic_init, attn,
                                                                cfg.gradient_checkpointing),
                       cfg.critic_learning_rate, **schedule)
    ref = frozen(accelerator, lambda: load_causal_lm(model_path, attn))
    block_mask = uses_block_mask(accelerator.unwrap_model(actor.model))
    hidden_size = accelerator.unwrap_model(actor.model).config.hidden_size  # packing.layout's pack-or-pad choice
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl
              else FixedKLController(cfg.kl_coef))
    accelerator.register_for_checkpointing(kl_ctl)

    reward_model = cfg.reward_model_name_or_path and load_reward_model(
        cfg.reward_model_name_or_path, lambda load: frozen(accelerator, load), device, cfg.max_length,
        cfg.per_device_eval_batch_size)
    reward = Rewards(cfg.reward_fn, reward_model or None, cfg.reward_weights, cfg.missing_eos_penalty)

    rollout_engine = rollout_backend(cfg, accelerator, accelerator.unwrap_model(actor.model), model_path, tokenizer,
                                     prompts[:cfg.vllm_probe_size])  # HF generate, vLLM engine or vLLM server
    sampling = cfg.sampling()

    resume = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    start = load_checkpoint(accelerator, resume)["step"] if resume else 0
    rollout_engine.load_weights(accelerator.unwrap_model(actor.model))  # weight sync: the rollout copy = the actor
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)
    info = lambda msg: logger.info(msg) if accelerator.is_main_process else None

    def micro_batches(items: list[int], costs: list[int]) -> list[list[int]]:
        return lockstep_micro_batches(accelerator, items, costs, cfg.max_tokens_per_microbatch,
                                      cfg.per_device_train_batch_size)

    def packed(ro, rows_):
        return pack_responses(ro.prompt_ids, ro.response_ids, ro.response_mask, rows_, pad, cfg.packing,
                              cfg.packing_length, block_mask, hidden_size)

    @torch.no_grad()
    def per_token(ro, fn, chunks) -> torch.Tensor:
        """(B, R) float32 of fn(batch, index) -> (M,) over every rollout row, micro-batch by micro-batch."""
        out = torch.zeros(ro.response_ids.shape, dtype=torch.float32)
        for rows_ in chunks:
            batch, ix = packed(ro, rows_)
            out[ix.row, ix.pos] = fn(batch.to(device), ix).float().cpu()
        return out

    def logprobs_of(model):
        return lambda batch, index: logprobs_from_logits(actor_logits(model, batch, index, cfg.temperature),
                                                         index.targets)

    def score(raw_prompts: list, ro) -> torch.Tensor:  # sequence scores (B,) of the decoded responses
        return reward.of_rollout(raw_prompts, ro, tokenizer)

    def tick(timing: dict, key: str, t0: float) -> None:
        timing[f"timing_s/{key}"] = timing.get(f"timing_s/{key}", 0.0) + time.time() - t0

    # ---- training loop -------------------------------------------------------------------------------------------
    for step in range(start, total_steps):
        timing, t_step = {}, time.time()
        # 1. rollout
        t0 = time.time()
        idx = step_indices(len(prompts), step, cfg.prompts_per_step, cfg.seed, rank, world)
        ro = rollout_engine.generate([prompts[i] for i in idx], sampling)
        tick(timing, "gen", t0)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        info(f"Step {step + 1}: rollout completed, generated {B * world} sequences")

        # 2. rewards: sequence scores (B,)
        t0 = time.time()
        scores = score([rows[i]["prompt"] for i in idx for _ in range(cfg.num_generations)], ro)
        n_seq, s_sum, s_sq = all_reduce_sum(accelerator, [B, scores.sum().item(), (scores ** 2).sum().item()])
        tick(timing, "reward", t0)
        info(f"Step {step + 1}: reward computed, avg score {s_sum / n_seq:.4f}")

        # 3. old log-probs (the actor before this update), reference log-probs and values
        lengths = mask.sum(-1)
        costs = [len(p) + int(n) for p, n in zip(ro.prompt_ids, lengths)]
        chunks = micro_batches(list(range(B)), costs)
        t0 = time.time()
        old_logprobs = (ro.sampling_logprobs if cfg.old_logprobs == "rollout"
                        else per_token(ro, logprobs_of(actor.model), chunks))
        ref_logprobs = per_token(ro, logprobs_of(ref), chunks)
        tick(timing, "ref", t0)
        t0 = time.time()
        old_values = per_token(ro, lambda b, ix: critic_values(critic.model, b, ix), chunks)
        tick(timing, "values", t0)

        # 4. advantages: KL penalty folded into per-token rewards, GAE, whitening over the global batch
        t0 = time.time()
        kl = kl_estimate(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask
        rewards = token_rewards(scores, kl, mask, kl_ctl.value)
        advantages = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        returns = advantages + old_values * mask
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask, torch.tensor(all_reduce_sum(accelerator, masked_moments(
                advantages, mask).tolist()), dtype=torch.float64))
        tick(timing, "adv", t0)

        # 5. PPO epochs over minibatches: actor and critic each take one optimizer step per minibatch
        sums = torch.zeros(7, dtype=torch.float64)  # tokens, pg_loss, pg_clipfrac, approx_kl, entropy, vf, vf_clip
        grad_norms = {"actor": [], "critic": []}
        for epoch in range(cfg.num_ppo_epochs):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + epoch)
            perm = torch.randperm(B, generator=g).tolist()
            size = -(-B // cfg.num_mini_batches)
            for mb in [perm[i:i + size] for i in range(0, B, size)]:
                mb_chunks = micro_batches(mb, [costs[i] for i in mb])
                n_tok = all_reduce_sum(accelerator, [float(lengths[mb].sum())])[0]  # minibatch tokens, all ranks
                t0 = time.time()
                for j, rows_ in enumerate(mb_chunks):
                    batch, ix = packed(ro, rows_)
                    batch = batch.to(device)
                    logits = actor_logits(actor.model, batch, ix, cfg.temperature)
                    logprobs = logprobs_from_logits(logits, ix.targets.to(device))
                    old, adv = old_logprobs[ix.row, ix.pos].to(device), advantages[ix.row, ix.pos].to(device)
                    pg = policy_loss(logprobs, old, adv, cfg.cliprange)
                    entropy = entropy_from_logits(logits)
                    # token mean over the minibatch on all ranks (see ppo_losses.token_mean_share)
                    last = j == len(mb_chunks) - 1
                    actor.backward(token_mean_share(pg - cfg.ent_coef * entropy, n_tok, world), last=last)
                    with torch.no_grad():  # approx_kl = mean 0.5 (log ratio)^2 (Schulman's k2)
                        sums[:5] += torch.tensor([len(pg), pg.sum().item(),
                                                  policy_clipped(logprobs, old, adv, cfg.cliprange).sum().item(),
                                                  (0.5 * (logprobs - old) ** 2).sum().item(), entropy.sum().item()])
                grad_norms["actor"].append(actor.step())
                tick(timing, "update_actor", t0)
                t0 = time.time()
                for j, rows_ in enumerate(mb_chunks):
                    batch, ix = packed(ro, rows_)
                    values = critic_values(critic.model, batch.to(device), ix)
                    old_v, ret = old_values[ix.row, ix.pos].to(device), returns[ix.row, ix.pos].to(device)
                    vf = value_loss(values, old_v, ret, cfg.cliprange_value)
                    critic.backward(token_mean_share(vf, n_tok, world), last=j == len(mb_chunks) - 1)
                    vf_clip = value_clipped(values.detach(), old_v, ret, cfg.cliprange_value)
                    sums[5:7] += torch.tensor([vf.sum().item(), vf_clip.sum().item()])
                grad_norms["critic"].append(critic.step())
                tick(timing, "update_critic", t0)
        actor.scheduler.step()
        critic.scheduler.step()

        # 6. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollout_engine.load_weights(accelerator.unwrap_model(actor.model)) or {}

        # ---- metrics, KL controller, checkpoint ----------------------------------------------------------------
        seq_kl = kl.sum(-1)
        ev = masked_moments(returns - old_values, mask).tolist() + masked_moments(returns, mask).tolist()
        stats = all_reduce_sum(accelerator, sums.tolist()[:7] + [seq_kl.sum().item(), float(lengths.sum()),
                                                                  float(lengths.max()), float(ro.truncated.sum()),
                                                                  float(sum(len(p) for p in ro.prompt_ids))] + ev)
        tokens, pg_l, pg_cf, akl, ent, vf_l, vf_cf, kl_sum, len_sum, _, n_trunc, prompt_tok = stats[:12]
        len_max = all_reduce_max(accelerator, int(lengths.max()))
        var = lambda c, s, q: q / c - (s / c) ** 2
        explained_var = 1.0 - var(*stats[12:15]) / max(var(*stats[15:18]), 1e-8)
        kl_mean = kl_sum / n_seq
        info(f"Step {step + 1}: PPO update done, KL divergence {kl_mean:.4f}")
        kl_coef = kl_ctl.value
        kl_ctl.update(kl_mean, int(n_seq))
        timing["timing_s/step"] = time.time() - t_step
        metrics = {"reward/mean": s_sum / n_seq, "reward/std": math.sqrt(max(var(n_seq, s_sum, s_sq), 0.0)),
                   "kl": kl_mean, "kl_coef": kl_coef,
                   "actor/pg_loss": pg_l / tokens, "actor/pg_clipfrac": pg_cf / tokens, "actor/approx_kl": akl / tokens,
                   "actor/entropy": ent / tokens,
                   "actor/grad_norm": sum(grad_norms["actor"]) / len(grad_norms["actor"]),
                   "critic/vf_loss": vf_l / tokens, "critic/vf_clipfrac": vf_cf / tokens,
                   "critic/explained_var": explained_var,
                   "critic/grad_norm": sum(grad_norms["critic"]) / len(grad_norms["critic"]),
                   "response_length/mean": len_sum / n_seq, "response_length/max": len_max,
                   "response_length/clip_ratio": n_trunc / n_seq,
                   "perf/tokens_per_s": (len_sum + prompt_tok) / timing["timing_s/step"],
                   "learning_rate": actor.scheduler.get_last_lr()[0], **timing, **sync_metrics}
        log.advance(reward=s_sum / n_seq)
        do_eval = test_prompts and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps)
        if do_eval:
            metrics.update(evaluate(accelerator, rollout_engine, test_prompts, [r["prompt"] for r in test_rows],
                                    replace(sampling, n=1), score, cfg.prompts_per_step // world))
        if (step + 1) % cfg.logging_steps == 0 or step == start or step + 1 == total_steps or do_eval:
            log.log(step + 1, metrics)
        if cfg.save_steps and (step + 1) % cfg.save_steps == 0:
            save_checkpoint(accelerator, cfg.output_dir, step + 1, {"total_steps": total_steps}, cfg.save_total_limit)

    rollout_engine.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    export_hf(accelerator, actor.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "critic/explained_var",
               "response_length/mean"])
    destroy()


if __name__ == "__main__":
    main()
