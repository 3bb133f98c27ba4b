"""GRPO for LLMs (Shao et al. 2024, DeepSeekMath): several responses per prompt, each scored; a response's advantage is
its score against its group's mean and standard deviation; clipped policy loss with a KL(policy || reference)
penalty in the loss; no critic. Rollouts from HF generate or vLLM, packed token-budget forward passes, ZeRO-3.

    python recipes/grpo.py                                  # one process, embedded tiny model and task
    python recipes/grpo.py --config recipes/configs/grpo_tiny.yaml
    python recipes/grpo.py --rollout vllm                   # a vLLM engine in the process generates
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/grpo.py
    make cluster-run RECIPE=recipes/grpo.py CONFIG=recipes/configs/grpo_tiny.yaml NODES=2

The embedded task is PPO's (recipes/ppo.py): the reward is the share of kind adjectives in the reply.
Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from verl_kit.actor_critic import Trainable, actor_logits, frozen, pack_responses
from verl_kit.advantages import group_advantages, kl_estimate
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
    loss_weights,
    policy_clipped,
    policy_loss,
)
from verl_kit.rewards import Rewards, load_reward_model
from verl_kit.rollout import evaluate, load_prompts
from verl_kit.vllm_rollout import OnlineConfig, rollout_backend

logger = logging.getLogger("verl_kit")


@dataclass
class GRPOConfig(OnlineConfig):
    num_generations: int = field(default=4, metadata={"help": "responses sampled per prompt (the group), >= 2"})
    scale_rewards: bool = field(default=True, metadata={
        "help": "divide advantages by the group's std (false: Dr. GRPO, centring only)"})
    beta: float = field(default=0.04, metadata={"help": "KL(policy || reference) coefficient in the loss (k3); "
                                                        "0 loads no reference model"})
    num_iterations: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    num_mini_batches: int = field(default=1, metadata={"help": "optimizer steps per pass"})
    cliprange: float = field(default=0.2, metadata={"help": "policy ratio clip epsilon"})
    loss_type: str = field(default="token", metadata={
        "help": "loss reduction: token (mean over all tokens), sequence (mean of per-response means) or dr_grpo"})


@main_guard
def main():
    cfg = parse_args(GRPOConfig)
    if cfg.loss_type not in ("token", "sequence", "dr_grpo"):
        raise UserError(f"--loss_type: {cfg.loss_type!r} is not one of token, sequence, dr_grpo")
    if cfg.num_generations < 2:
        raise UserError(f"--num_generations {cfg.num_generations}: GRPO compares responses within a group, use >= 2")
    accelerator = make_accelerator(cfg)
    setup_logging(accelerator.is_main_process)
    check_writable(cfg.output_dir)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    cfg.check(world)

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
    actor = Trainable(accelerator, load_causal_lm(model_path, attn, cfg.gradient_checkpointing), cfg.learning_rate,
                      weight_decay=cfg.weight_decay, scheduler_type=cfg.lr_scheduler_type, total_steps=total_steps,
                      warmup_steps=int(cfg.warmup_ratio * total_steps), max_grad_norm=cfg.max_grad_norm)
    ref = frozen(accelerator, lambda: load_causal_lm(model_path, attn)) if cfg.beta > 0 else None
    block_mask = uses_block_mask(accelerator.unwrap_model(actor.model))
    hidden_size = accelerator.unwrap_model(actor.model).config.hidden_size  # packing.layout's pack-or-pad choice
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
    one_update = cfg.num_iterations * cfg.num_mini_batches == 1  # then old log-probs = this forward's, detached

    def micro_batches(items: list[int], costs: list[int]) -> list[list[int]]:
        return lockstep_micro_batches(accelerator, items, costs, cfg.max_tokens_per_microbatch,
                                      cfg.per_device_train_batch_size)

    def packed(ro, rows_):
        return pack_responses(ro.prompt_ids, ro.response_ids, ro.response_mask, rows_, pad, cfg.packing,
                              cfg.packing_length, block_mask, hidden_size)

    @torch.no_grad()
    def logprobs_of(model, ro, chunks) -> torch.Tensor:
        """(B, R) log-probs of the response tokens under `model`, micro-batch by micro-batch."""
        out = torch.zeros(ro.response_ids.shape, dtype=torch.float32)
        for rows_ in chunks:
            batch, ix = packed(ro, rows_)
            logits = actor_logits(model, batch.to(device), ix, cfg.temperature)
            out[ix.row, ix.pos] = logprobs_from_logits(logits, ix.targets.to(device)).float().cpu()
        return out

    def score(raw_prompts: list, ro) -> torch.Tensor:  # sequence scores (B,) of the decoded responses
        return reward.of_rollout(raw_prompts, ro, tokenizer)

    def tick(timing: dict, key: str, t0: float) -> None:
        timing[f"timing_s/{key}"] = timing.get(f"timing_s/{key}", 0.0) + time.time() - t0

    # ---- training loop -------------------------------------------------------------------------------------------
    for step in range(start, total_steps):
        timing, t_step = {}, time.time()
        # 1. rollout: num_generations responses per prompt, a prompt's group on one process
        t0 = time.time()
        idx = step_indices(len(prompts), step, cfg.prompts_per_step, cfg.seed, rank, world)
        ro = rollout_engine.generate([prompts[i] for i in idx], sampling)
        tick(timing, "gen", t0)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        info(f"Step {step + 1}: rollout completed, generated {B * world} sequences")

        # 2. rewards and group-relative advantages (B,)
        t0 = time.time()
        scores = score([rows[i]["prompt"] for i in idx for _ in range(cfg.num_generations)], ro)
        advantages = group_advantages(scores, cfg.num_generations, cfg.scale_rewards)
        group_std = scores.view(-1, cfg.num_generations).std(-1)
        n_seq, s_sum, s_sq, flat = all_reduce_sum(accelerator, [B, scores.sum().item(), (scores ** 2).sum().item(),
                                                                float((group_std == 0).sum())])
        tick(timing, "reward", t0)
        info(f"Step {step + 1}: reward computed, avg score {s_sum / n_seq:.4f}")

        # 3. reference log-probs (for the KL term) and, with several updates per rollout, the old log-probs
        lengths = mask.sum(-1)
        costs = [len(p) + int(n) for p, n in zip(ro.prompt_ids, lengths)]
        t0 = time.time()
        chunks = micro_batches(list(range(B)), costs)
        ref_logprobs = logprobs_of(ref, ro, chunks) if ref is not None else None
        old_logprobs = None if one_update else (ro.sampling_logprobs if cfg.old_logprobs == "rollout"
                                                else logprobs_of(actor.model, ro, chunks))
        tick(timing, "ref", t0)

        # 4. updates: num_iterations passes over the batch, num_mini_batches optimizer steps each
        sums = torch.zeros(6, dtype=torch.float64)  # tokens, pg_loss, clipfrac, approx_kl, entropy, kl
        grad_norms = []
        for it in range(cfg.num_iterations):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + it)
            perm = torch.randperm(B, generator=g).tolist()
            size = -(-B // cfg.num_mini_batches)
            for mb in [perm[i:i + size] for i in range(0, B, size)]:
                mb_chunks = micro_batches(mb, [costs[i] for i in mb])
                n_tok, n_seq_mb = all_reduce_sum(accelerator, [float(lengths[mb].sum()), float(len(mb))])  # all ranks
                t0 = time.time()
                for j, rows_ in enumerate(mb_chunks):
                    batch, ix = packed(ro, rows_)
                    logits = actor_logits(actor.model, batch.to(device), ix, cfg.temperature)
                    logprobs = logprobs_from_logits(logits, ix.targets.to(device))
                    old = logprobs.detach() if one_update else old_logprobs[ix.row, ix.pos].to(device)
                    adv = advantages[ix.row].to(device)  # a response's advantage on each of its tokens
                    loss = policy_loss(logprobs, old, adv, cfg.cliprange)
                    kl = (kl_estimate(logprobs, ref_logprobs[ix.row, ix.pos].to(device), "k3") if ref is not None
                          else torch.zeros_like(logprobs))
                    # this micro-batch's share of the minibatch loss on all ranks (ppo_losses.loss_weights)
                    w = loss_weights(cfg.loss_type, lengths[ix.row], n_tok, n_seq_mb, cfg.max_completion_length)
                    actor.backward(((loss + cfg.beta * kl) * w.to(device)).sum() * world, last=j == len(mb_chunks) - 1)
                    with torch.no_grad():
                        sums += torch.tensor([len(loss), loss.sum().item(),
                                              policy_clipped(logprobs, old, adv, cfg.cliprange).sum().item(),
                                              (0.5 * (logprobs - old) ** 2).sum().item(),
                                              entropy_from_logits(logits).sum().item(), kl.sum().item()])
                grad_norms.append(actor.step())
                tick(timing, "update_actor", t0)
        actor.scheduler.step()

        # 5. weight sync: the rollout engine generates with the updated actor from the next step on
        sync_metrics = rollout_engine.load_weights(accelerator.unwrap_model(actor.model)) or {}

        # ---- metrics, checkpoint -------------------------------------------------------------------------------
        stats = all_reduce_sum(accelerator, sums.tolist() + [float(lengths.sum()), float(ro.truncated.sum()),
                                                             float(sum(len(p) for p in ro.prompt_ids))])
        tokens, pg_l, clip, akl, ent, kl_sum, len_sum, n_trunc, prompt_tok = stats
        len_max = all_reduce_max(accelerator, int(lengths.max()))
        info(f"Step {step + 1}: GRPO update done, KL divergence {kl_sum / tokens:.4f}")
        timing["timing_s/step"] = time.time() - t_step
        metrics = {"reward/mean": s_sum / n_seq, "reward/std": math.sqrt(max(s_sq / n_seq - (s_sum / n_seq) ** 2, 0.0)),
                   "reward/frac_zero_std": flat / (n_seq / cfg.num_generations), "kl": kl_sum / tokens,
                   "actor/pg_loss": pg_l / tokens, "actor/pg_clipfrac": clip / tokens, "actor/approx_kl": akl / tokens,
                   "actor/entropy": ent / tokens, "actor/grad_norm": sum(grad_norms) / len(grad_norms),
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
    log.close(["reward/mean", "eval/reward_mean", "kl", "actor/entropy", "response_length/mean"])
    destroy()


if __name__ == "__main__":
    main()
