"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025, "On-Policy Distillation"): the student
samples, a frozen teacher scores every sampled token, and the student is pushed toward the teacher where it actually
goes: a dense per-token signal instead of one reward per response. No critic, no reference model, no reward needed.
Two losses (docs/distill.md):
  --loss_type reverse_kl   per-token advantage A_t = -(log p_student - log q_teacher) of the sampled token, trained
                           with the clipped policy loss (tinker-cookbook's distillation/train_on_policy.py); the
                           teacher gives one log-prob per token
  --loss_type jsd          TRL's generalized JSD over the full vocabulary, --beta 0 forward KL, 1 reverse KL, between
                           the JSD (TRL's DistillationTrainer)
A task reward (--reward_fn) is logged, evaluated held out (its accuracy where the task has an answer) and, with
--task_reward_coef > 0, added to the advantage. Teacher and student must share a tokenizer (checked at start).

    python recipes/distill.py --teacher_model_name_or_path outputs/sft-tiny/final     # after recipes/sft.py
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml --loss_type jsd --beta 0.5
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml --rollout vllm --async_rollout
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/distill.py \
        --config recipes/configs/distill_tiny.yaml
    make cluster-run RECIPE=recipes/distill.py CONFIG=recipes/configs/distill_tiny.yaml NODES=2

Copy this file and edit it; `verl_kit` holds only mechanism.
"""

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

from verl_kit.algos import (
    clipped_surrogate,
    entropy_from_logits,
    generalized_jsd,
    global_mean_share,
    group_advantages,
    reverse_kl_advantages,
    reweight,
    step_metrics,
    surrogate_clipped,
)
from verl_kit.config import OnlineConfig, parse_args
from verl_kit.data import logprobs_from_logits
from verl_kit.errors import UserError, main_guard
from verl_kit.metrics import MetricsLogger, Timer, logger
from verl_kit.models import (
    export_hf,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
    with_lora,
)
from verl_kit.rewards import make_rewards
from verl_kit.rollout import load_prompt_splits, rollout_metrics, sample_rows, start_rollouts
from verl_kit.train import (
    ResponsePacker,
    Tally,
    Trainable,
    actor_logits,
    derived_seed,
    destroy,
    load_teacher,
    make_accelerator,
    micro_batches,
    minibatches,
    reduce_metrics,
    save_if_due,
)


@dataclass
class DistillConfig(OnlineConfig):
    CHOICES: ClassVar[dict] = {"loss_type": ("reverse_kl", "jsd")}

    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "the frozen teacher (HF id or local path; required): same tokenizer as the student, may be larger; "
                "sharded like a reference model under ZeRO-3 (TRL's flag)"})
    loss_type: str = field(default="reverse_kl", metadata={
        "help": "reverse_kl (per-token advantage -(log p_student - log q_teacher) of the sampled token, clipped "
                "policy loss) or jsd (TRL's generalized JSD over the full vocabulary, see --beta)"})
    beta: float = field(default=1.0, metadata={
        "help": "--loss_type jsd: TRL's interpolation coefficient, 0 forward KL(teacher || student), 1 reverse "
                "KL(student || teacher), between the generalized JSD (0.5 the JSD)"})
    num_generations: int = field(default=1, metadata={
        "help": "responses sampled per prompt; >= 2 with --task_reward_coef (the reward is centred per prompt)"})
    num_iterations: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    num_mini_batches: int = field(default=1, metadata={"help": "optimizer steps per pass"})
    task_reward_coef: float = field(default=0.0, metadata={
        "help": "weight of the task reward (--reward_fn; centred on its prompt's mean) added to every token's "
                "advantage (--loss_type reverse_kl); 0: the reward is only logged and evaluated"})

    @property
    def has_reward(self) -> bool:
        return bool(self.reward_model_name_or_path) or any(
            s.strip() not in ("", "none") for s in (self.reward_fn or "").split(","))

    def check(self, world: int) -> None:
        super().check(world)
        if not self.teacher_model_name_or_path:
            raise UserError("--teacher_model_name_or_path is required: the frozen model the student learns from")
        if not 0.0 <= self.beta <= 1.0:
            raise UserError(f"--beta {self.beta}: the JSD interpolation coefficient must be in [0, 1]")
        mixable = self.loss_type == "reverse_kl" and self.num_generations >= 2 and self.has_reward
        if self.task_reward_coef and not mixable:
            raise UserError(f"--task_reward_coef {self.task_reward_coef} needs --loss_type reverse_kl, "
                            "--num_generations >= 2 and a --reward_fn (or --reward_model_name_or_path)")


def teacher_view(disagreement: torch.Tensor, response_ids: torch.Tensor, n: int, tokenizer) -> dict:
    """A sampled response's mean log p - log q over its n tokens, and its three most disputed tokens with theirs."""
    worst = disagreement[:n].topk(min(3, n)).indices.tolist() if n else []
    return {"teacher_kl": float(disagreement[:n].sum()) / max(n, 1),
            "disputed": [[tokenizer.decode([int(response_ids[p])]), round(float(disagreement[p]), 3)] for p in worst]}


@main_guard
def main():
    cfg = parse_args(DistillConfig)
    accelerator = make_accelerator(cfg)
    world, device = accelerator.num_processes, accelerator.device
    cfg.check(world)
    one_update = cfg.num_iterations * cfg.num_mini_batches == 1  # then old log-probs = this forward's, detached
    if accelerator.is_main_process and cfg.loss_type == "reverse_kl" and cfg.beta != 1.0:
        logger.warning("--beta %s has no effect with --loss_type reverse_kl", cfg.beta)

    # ---- data, student, teacher, rewards -------------------------------------------------------------------------
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    train, test = load_prompt_splits(cfg, tokenizer)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * len(train.ids)
                                                                      / cfg.prompts_per_step)
    attn = cfg.attn_implementation
    actor = Trainable(accelerator, with_lora(load_causal_lm(model_path, attn, cfg.gradient_checkpointing), cfg), cfg,
                      cfg.learning_rate, total_steps)
    # frozen, ZeRO-3 sharded like a reference; its tokenizer checked to be the student's (one line otherwise)
    teacher = load_teacher(accelerator, cfg.teacher_model_name_or_path, tokenizer, attn)
    widths = (actor.unwrapped().config.vocab_size, getattr(teacher, "module", teacher).config.vocab_size)
    if cfg.loss_type == "jsd" and widths[0] != widths[1]:
        raise UserError(f"--loss_type jsd compares whole distributions: the student has {widths[0]} logits and the "
                        f"teacher {widths[1]}; use --loss_type reverse_kl (sampled tokens only)")
    packed = ResponsePacker(cfg, tokenizer.pad_token_id, actor.unwrapped())
    reward = make_rewards(cfg, accelerator, tokenizer) if cfg.has_reward else None
    rollouts, start = start_rollouts(cfg, accelerator, actor.unwrapped(), model_path, tokenizer, train.ids,
                                     total_steps)
    log = MetricsLogger(accelerator, cfg.output_dir, total_steps, start, asdict(cfg), cfg.run_name)

    def evaluate() -> dict:
        """Held out: the task reward (its accuracy where the task has an answer) and the per-token reverse KL
        log p - log q of the student's sampled tokens, total over total tokens (eval/teacher_kl)."""
        def kl_sum(rows, ro):  # (B,) sum over each response's tokens; every process calls it alike (ZeRO-3)
            costs = ro.costs
            chunks = micro_batches(cfg, list(range(len(costs))), costs)
            diff = packed.logprobs(actor.model, ro, chunks, device) - packed.logprobs(teacher, ro, chunks, device)
            return (diff * ro.response_mask).sum(-1)
        score = reward.of_rollout if reward else lambda rows, ro: torch.zeros(len(rows))
        m = rollouts.evaluate(accelerator, test, score, cfg.prompts_per_step // world, extra=lambda r, ro: {
            "teacher_kl_sum": kl_sum(r, ro)})
        m["eval/teacher_kl"] = m.pop("eval/teacher_kl_sum") / max(m["eval/response_length"], 1e-8)
        return m if reward else {k: v for k, v in m.items() if not k.startswith(("eval/reward", "eval/pass@"))}

    if start == 0 and test.ids:
        log.log(0, evaluate())

    # ---- training loop -------------------------------------------------------------------------------------------
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout: the student's samples (any backend; with --async_rollout generated during the last update)
        with timer("gen"):
            ro, staleness = rollouts.get(step)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        lengths = mask.sum(-1)
        costs = ro.costs  # tokens of each row's forward pass
        rows = [train.rows[i] for i in ro.prompt_index]

        # 2. the task reward (logged; with --task_reward_coef centred per prompt and added to each token's advantage)
        with timer("reward"):
            scores = reward.of_rollout(rows, ro) if reward else torch.zeros(B)
            task_adv = (cfg.task_reward_coef * group_advantages(scores, cfg.num_generations, False)
                        if cfg.task_reward_coef else torch.zeros(B))

        # 3. the teacher's log-prob of every sampled token (reverse_kl; jsd needs its logits, in the update below)
        #    and, with several updates per rollout, the student's old log-probs
        student_lp = torch.zeros(mask.shape)  # the student before this step's update, for metrics and samples
        with timer("teacher"):
            chunks = micro_batches(cfg, list(range(B)), costs)
            teacher_lp = (packed.logprobs(teacher, ro, chunks, device) if cfg.loss_type == "reverse_kl"
                          else torch.zeros(mask.shape))
            old_logprobs = None if one_update else (
                ro.sampling_logprobs if cfg.old_logprobs == "rollout"
                else packed.logprobs(actor.model, ro, chunks, device))

        # 4. updates: num_iterations passes over the batch, num_mini_batches optimizer steps each, token mean
        tally, grad_norms = Tally(), []
        for it in range(cfg.num_iterations):
            mbs = minibatches(B, cfg.num_mini_batches, derived_seed(cfg.seed, step, it))
            for j, mb in enumerate(mbs):
                mb_chunks = micro_batches(cfg, mb, [costs[i] for i in mb])
                n_tok = reduce_metrics({"n": lengths[mb].sum()})["n"]  # minibatch tokens, all ranks
                with timer("update_actor"):
                    for chunk in actor.accumulate(mb_chunks):
                        batch, ix = packed(ro, chunk)
                        batch = batch.to(device)
                        logits = actor_logits(actor.model, batch, ix, cfg.temperature)
                        logprobs = logprobs_from_logits(logits, ix.targets.to(device))
                        old = logprobs.detach() if one_update else old_logprobs[ix.row, ix.pos].to(device)
                        if cfg.loss_type == "jsd":  # the teacher's whole distribution at each sampled position
                            with torch.no_grad():
                                t_logits = actor_logits(teacher, batch, ix, cfg.temperature)
                            t_lp = logprobs_from_logits(t_logits, ix.targets.to(device))
                            loss = generalized_jsd(logits, t_logits, cfg.beta)
                            clipped = torch.zeros_like(loss)
                            if it == 0:
                                teacher_lp[ix.row, ix.pos] = t_lp.cpu()
                        else:
                            t_lp = teacher_lp[ix.row, ix.pos].to(device)
                            adv = reverse_kl_advantages(old, t_lp) + task_adv[ix.row].to(device)
                            loss = clipped_surrogate(logprobs - old, adv, cfg.cliprange, cfg.epsilon_high)
                            clipped = surrogate_clipped(logprobs - old, adv, cfg.cliprange, cfg.epsilon_high)
                        # the engine sampled from mu, not pi_old: importance weights (verl_kit.algos.off_policy)
                        loss = reweight(cfg, loss, old, ro.sampling_logprobs[ix.row, ix.pos].to(device),
                                        ix.row.to(device), B, tally if it == 0 else None)
                        actor.backward(global_mean_share(loss, n_tok, world))
                        with torch.no_grad():
                            tally.add(tokens=len(loss), loss=loss, pg_clipfrac=clipped,
                                      approx_kl=0.5 * (logprobs - old) ** 2, entropy=entropy_from_logits(logits))
                            if it == 0:  # the per-token reverse KL of the samples, before this step's update
                                tally.add(teacher_kl=old - t_lp, kl_tokens=len(loss))
                                student_lp[ix.row, ix.pos] = old.float().cpu()
                    last_update = it == cfg.num_iterations - 1 and j == len(mbs) - 1  # LR schedule: once per step
                    grad_norms.append(actor.step(schedule=last_update))

        # 5. weight sync: the rollout engine generates with the updated student from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, samples, checkpoint ----------------------------------------------------------------------
        t = tally.reduce()
        timer.seconds["timing_s/step"] = time.time() - t_step
        metrics = {**rollout_metrics(ro, scores, timer.seconds["timing_s/step"]),
                   "teacher_kl": t["teacher_kl"] / t["kl_tokens"],
                   **{f"actor/{k}": t[k] / t["tokens"] for k in ("loss", "pg_clipfrac", "approx_kl", "entropy")},
                   "grad_norm": sum(grad_norms) / len(grad_norms), "learning_rate": actor.learning_rate,
                   "rollout/staleness": staleness, **step_metrics(t), **timer.seconds, **sync_metrics}
        if not reward:
            metrics = {k: v for k, v in metrics.items() if not k.startswith("reward/")}
        log.advance(teacher_kl=metrics["teacher_kl"])
        do_eval = test.ids and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total_steps)
        if do_eval:
            metrics.update(evaluate())
        if (step + 1) % cfg.logging_steps == 0 or step == start or step + 1 == total_steps or do_eval:
            log.log(step + 1, metrics)
            disagreement = (student_lp - teacher_lp) * mask  # log p - log q of each sampled token
            views = [teacher_view(disagreement[i], ro.response_ids[i], int(lengths[i]), tokenizer) for i in range(B)]
            log.log_samples(sample_rows(step + 1, rows, ro, scores, tokenizer, extra=views))
        save_if_due(accelerator, cfg, step + 1, per_rank=rollouts)

    rollouts.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    export_hf(accelerator, actor.model, tokenizer, os.path.join(cfg.output_dir, "final"))
    log.close(["teacher_kl", "eval/teacher_kl", "eval/reward_mean", "actor/entropy", "response_length/mean"])
    destroy()


if __name__ == "__main__":
    main()
