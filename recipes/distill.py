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
Self-distillation (TRL's SDFT; --teacher_model_kind base|live|ema instead of a teacher path): the teacher is the
student itself, reading each prompt with its row's privileged_context (a reference solution, feedback), which the
student never sees; the student learns to do without it what it does with it.

    python recipes/distill.py --teacher_model_name_or_path outputs/sft-tiny/final     # after recipes/sft.py
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml --loss_type jsd --beta 0.5
    python recipes/distill.py --config recipes/configs/distill_tiny.yaml --rollout vllm --async_rollout
    python recipes/distill.py --teacher_model_kind base --dataset_name rows_with_privileged_context.jsonl ...
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/distill.py \
        --config recipes/configs/distill_tiny.yaml
    make cluster-run RECIPE=recipes/distill.py CONFIG=recipes/configs/distill_tiny.yaml NODES=2

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
class DistillConfig(config.Config):
    """Distillation's own knobs: the loss and the task reward's weight; the teacher is config.TeacherConfig, the rest
    of its flags are the online roles (no environments: the teacher scores single-turn samples)."""

    CHOICES: ClassVar[dict] = {"loss_type": ("reverse_kl", "jsd")}

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

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.beta <= 1.0:
            raise UserError(f"--beta {self.beta}: the JSD interpolation coefficient must be in [0, 1]")
        self.at_least(1, "num_generations", "num_iterations", "num_mini_batches")
        if self.loss_type == "reverse_kl" and self.beta != 1.0:
            config.warn(f"--beta {self.beta} has no effect with --loss_type reverse_kl")

    def check_with(self, cfg: config.Args) -> None:
        mixable = self.loss_type == "reverse_kl" and self.num_generations >= 2 and cfg.rewards.any
        if self.task_reward_coef and not mixable:
            raise UserError(f"--task_reward_coef {self.task_reward_coef} needs --loss_type reverse_kl, "
                            "--num_generations >= 2 and a --reward_fn (or --reward_model_name_or_path)")
        if cfg.rollout.curriculum != "none" and not cfg.rewards.any:
            raise UserError("--curriculum difficulty draws prompts by their solve rates: it needs a --reward_fn (or "
                            "--reward_model_name_or_path)")

    @property
    def one_update(self) -> bool:
        """One optimizer step per rollout: the old log-probs are the update's own forward, detached."""
        return self.num_iterations * self.num_mini_batches == 1


ARGS = {"distill": DistillConfig, "teacher": config.TeacherConfig, "train": config.TrainConfig,
        "rollout": config.RolloutConfig, "vllm": config.VLLMConfig, "rewards": config.RewardConfig,
        "ratio": config.RatioConfig, "entropy": config.EntropyConfig}


def teacher_view(disagreement: torch.Tensor, response_ids: torch.Tensor, n: int, tokenizer) -> dict:
    """A sampled response's mean log p - log q over its n tokens, and its three most disputed tokens with theirs."""
    worst = disagreement[:n].topk(min(3, n)).indices.tolist() if n else []
    return {"teacher_kl": float(disagreement[:n].sum()) / max(n, 1),
            "disputed": [[tokenizer.decode([int(response_ids[p])]), round(float(disagreement[p]), 3)] for p in worst]}


@main_guard
def main():
    cfg = config.parse(**ARGS)
    dist, teach, flags = cfg.distill, cfg.teacher, cfg.flags()
    accelerator = train.make_accelerator(cfg.train)
    world, device = accelerator.num_processes, accelerator.device

    # ---- data, student, teacher, rewards -------------------------------------------------------------------------
    model_path = models.resolve_model_path(cfg.train.model_name_or_path)
    tokenizer = models.load_tokenizer(model_path, cfg.train.chat_template_kwargs)
    prompts, held_out = data.load_prompt_splits(cfg.train, tokenizer)
    total_steps = cfg.train.total_steps(len(prompts.ids), cfg.rollout.prompts_per_step)
    attn = cfg.train.attn_implementation
    # where the rows have a privileged_context (self-distillation needs one), the teacher reads it with the prompt
    sees = (data.TeacherPrompts(tokenizer, teach.teacher_prompt_template,
                                cfg.train.max_length - cfg.rollout.max_completion_length,
                                (prompts, cfg.train.train_source), (held_out, cfg.train.test_source))
            if teach.teacher_model_kind or any(data.PRIVILEGED in r for r in prompts.rows) else None)
    # before any weight: each term of a step in GiB against the memory the run may use; refuses what cannot fit
    memory = train.plan_memory(accelerator, cfg.train, model_path, prompts.ids,
                               frozen=teach.frozen_copies(model_path, cfg.train.use_peft),
                               rollout=cfg.rollout, vllm=cfg.vllm, generations=dist.num_generations)
    policy = models.without_dropout(models.load_policy(model_path, cfg.train))  # see models.without_dropout
    actor = train.Trainable(accelerator, policy, cfg.train, cfg.train.learning_rate, total_steps)  # the student
    ema = None  # --teacher_model_kind ema: the average of the student, moved after each optimizer step
    if teach.teacher_model_kind:  # self-distillation: the student itself (live), its initial weights, or their EMA
        teacher, ema = train.self_teacher(accelerator, actor, teach.teacher_model_kind, model_path, attn,
                                          cfg.train.use_peft, teach.teacher_update_rate, teach.teacher_sync_steps)
    else:  # frozen, ZeRO-3 sharded like a reference; its tokenizer checked to be the student's (one line otherwise)
        teacher = train.load_teacher(accelerator, teach.teacher_model_name_or_path, tokenizer, attn)
    widths = (actor.unwrapped().config.vocab_size, getattr(teacher, "module", teacher).config.vocab_size)
    if dist.loss_type == "jsd" and widths[0] != widths[1]:
        raise UserError(f"--loss_type jsd compares whole distributions: the student has {widths[0]} logits and the "
                        f"teacher {widths[1]}; use --loss_type reverse_kl (sampled tokens only)")
    packed = train.ResponsePacker(cfg.train, tokenizer.pad_token_id, actor.unwrapped(), cfg.rollout.temperature)
    reward = (rewards.make_rewards(cfg.rewards, accelerator, tokenizer, cfg.train.max_length,
                                   cfg.train.per_device_eval_batch_size) if cfg.rewards.any else None)
    ent = train.EntropyTerms(cfg.entropy, accelerator)  # TRL's entropy controls (off by default), checkpointed
    rollouts = rollout.make_rollouts(accelerator, actor.unwrapped(), tokenizer, prompts, rollout=cfg.rollout,
                                     vllm=cfg.vllm, train=cfg.train, model_path=model_path, total_steps=total_steps,
                                     num_generations=dist.num_generations)
    # its checkpoints: the run's id, save clock and stop signal, and the flags a resume must find unchanged
    ckpt = train.Checkpoints(accelerator, cfg.train, cfg.resume_checked(),
                             per_rank=train.PerRank(rollouts=rollouts, teacher=ema))
    start = ckpt.resume()  # 0 unless --resume_from_checkpoint
    rollouts.load_weights(actor.unwrapped(), version=start)  # the engine samples from the (restored) student
    log = MetricsLogger(accelerator, cfg.train.output_dir, total_steps, start, flags, cfg.train.run_name)
    correct = train.OffPolicyCorrection(cfg.ratio, cfg.rollout.backend)  # engine samples: weight by pi_old / mu

    def evaluate() -> dict:
        """Held out: the task reward (its accuracy where the task has an answer) and the per-token reverse KL
        log p - log q of the student's sampled tokens, total over total tokens (eval/teacher_kl)."""
        def kl_sum(ro):  # (B,) sum over each response's tokens; every process calls it alike (ZeRO-3)
            chunks = train.micro_batches(cfg.train, list(range(len(ro.costs))), ro.costs)
            theirs = sees.view(ro, 1) if sees else ro
            diff = packed.logprobs(actor.model, ro, chunks, device) - packed.logprobs(teacher, theirs, chunks, device)
            return (diff * ro.response_mask).sum(-1)
        score = reward.of_rollout if reward else lambda ro: rollout.Scores(torch.zeros(len(ro.prompt_ids)))
        m = rollouts.evaluate(accelerator, held_out, score, cfg.rollout.prompts_per_step // world,
                              extra=lambda ro: {"teacher_kl_sum": kl_sum(ro)})
        m["eval/teacher_kl"] = m.pop("eval/teacher_kl_sum") / max(m["eval/response_length"], 1e-8)
        return m if reward else {k: v for k, v in m.items() if not k.startswith(("eval/reward", "eval/pass@"))}

    if start == 0 and held_out.ids:
        log.log(0, {**memory.metrics(), **evaluate()})

    # ---- training loop -------------------------------------------------------------------------------------------
    actor.model.train()  # for gradient checkpointing (evaluation and the probe put it back after their eval mode)
    stop = 0  # the signal that stopped the run (preemption), once saved
    for step in range(start, total_steps):
        timer, t_step = Timer(), time.time()
        # 1. rollout: the student's samples (any backend; with --async_rollout generated during the last update)
        with timer("gen"):
            ro, lag = rollouts.get(step)
        mask, B = ro.response_mask, ro.response_mask.shape[0]
        lengths = mask.sum(-1)
        costs = ro.costs  # tokens of each row's forward pass
        theirs = sees.view(ro) if sees else ro  # what the teacher reads: its prompts, the same responses

        # 2. the task reward (logged; with --task_reward_coef centred per prompt and added to each token's advantage)
        with timer("reward"):
            scored = reward.of_rollout(ro) if reward else rollout.Scores(torch.zeros(B))
            scores = scored.total
            task_adv = (dist.task_reward_coef * algos.group_advantages(scores, dist.num_generations, False)
                        if dist.task_reward_coef else torch.zeros(B))
        curriculum = rollouts.observe(ro, scored)  # --curriculum: the solve rates the next draws follow

        # 3. the teacher's log-prob of every sampled token (reverse_kl; jsd needs its logits, in the update below)
        #    and, with several updates per rollout, the student's old log-probs
        student_lp = torch.zeros(mask.shape)  # the student before this step's update, for metrics and samples
        with timer("teacher"):
            chunks = train.micro_batches(cfg.train, list(range(B)), costs)
            teacher_lp = (packed.logprobs(teacher, theirs, chunks, device) if dist.loss_type == "reverse_kl"
                          else torch.zeros(mask.shape))
            old_logprobs = None if dist.one_update else packed.old_logprobs(actor.model, ro, chunks, device,
                                                                            cfg.ratio.old_logprobs)

        # 4. updates: num_iterations passes over the batch, num_mini_batches optimizer steps each, token mean
        tally, grad_norms = train.Tally(), []
        updates = train.updates(cfg.train, step, costs, dist.num_iterations, dist.num_mini_batches,
                                (actor,), tally)
        for update in timer.each("update_actor", updates):
            n_tok = train.reduce_metrics({"n": lengths[update.rows].sum()})["n"]  # minibatch tokens, all ranks
            first = update.epoch == 0  # the first pass over the batch: the samples' reverse KL, before any update
            with update:  # out of memory inside: nothing applied, the update comes again at half the tokens
                ent.start()  # --entropy_coef and friends: this optimizer step's coefficient
                for chunk in actor.accumulate(update.chunks):
                    if dist.loss_type == "jsd":  # both models' whole distributions at each sampled position
                        logprobs, entropy, jsd, t_lp, ix = packed.divergence(actor.model, teacher, ro, chunk, device,
                                                                             dist.beta, theirs)
                    else:
                        logprobs, entropy, ix = packed.forward(actor.model, ro, chunk, device)
                    old = logprobs.detach() if dist.one_update else ix.gather(old_logprobs, device)
                    if dist.loss_type == "jsd":  # algos.generalized_jsd, in chunks through both LM heads
                        loss, clipped = jsd, torch.zeros_like(old)
                    else:
                        t_lp = ix.gather(teacher_lp, device)
                        adv = algos.reverse_kl_advantages(old, t_lp) + ix.gather(task_adv, device)
                        loss, clipped = algos.clipped_surrogate(logprobs, logprobs - old, adv, cfg.ratio.cliprange,
                                                                cfg.ratio.epsilon_high)
                    loss = correct(loss, old, ro, ix, device, tally, measure=first)
                    acting, bonus = ent.terms(entropy, None, n_tok, len(update.chunks))
                    if acting is not None:  # --top_entropy_quantile: the loss on the high-entropy tokens only
                        loss = loss * acting
                    share = algos.global_mean_share(loss, n_tok, world)
                    actor.backward(share if bonus is None else share + algos.global_mean_share(bonus, 1.0, world))
                    tally.add(tokens=len(loss), loss=loss, pg_clipfrac=clipped,  # Tally detaches
                              approx_kl=0.5 * (logprobs - old) ** 2, entropy=entropy)
                    if first:  # the per-token reverse KL of the samples, before this step's update
                        tally.add(teacher_kl=old - t_lp, kl_tokens=len(loss))
                        student_lp[ix.row, ix.pos], teacher_lp[ix.row, ix.pos] = old.float().cpu(), t_lp.cpu()
                grad_norms.append(actor.step(schedule=update.last))  # the LR schedule advances once per step
            if ema:
                ema.after_step()  # --teacher_model_kind ema: the teacher moves toward the updated student
            entropy_metrics = ent.end()  # --use_adaptive_entropy: the coefficient moves

        # 5. weight sync: the rollout engine generates with the updated student from the next step on
        sync_metrics = rollouts.load_weights(actor.unwrapped(), version=step + 1)

        # ---- metrics, samples, checkpoint ----------------------------------------------------------------------
        t = tally.reduce()
        timer.seconds["timing_s/step"] = time.time() - t_step
        metrics = {**rollout.rollout_metrics(ro, scored, timer.seconds["timing_s/step"], (), prompts.sources),
                   "teacher_kl": t["teacher_kl"] / t["kl_tokens"],
                   **{f"actor/{k}": t[k] / t["tokens"] for k in ("loss", "pg_clipfrac", "approx_kl", "entropy")},
                   **actor.metrics(grad_norms), **lag, **algos.step_metrics(t),
                   **curriculum, **timer.seconds, **sync_metrics, **entropy_metrics}
        if not reward:
            metrics = {k: v for k, v in metrics.items() if not k.startswith("reward/")}
        if log.end_step(step + 1, metrics, cfg.train.logging_steps, cfg.train.eval_steps,
                        evaluate if held_out.ids else None, progress="teacher_kl"):  # and a few samples beside
            disagreement = (student_lp - teacher_lp) * mask  # log p - log q of each sampled token
            views = [teacher_view(disagreement[i], ro.response_ids[i], int(lengths[i]), tokenizer) for i in range(B)]
            log.log_samples(rollout.sample_rows(step + 1, ro, scores, tokenizer, extra=views))
        if stop := ckpt.save_if_due(step + 1):
            break  # saved: the run ends below, without an export

    rollouts.close()  # stop a vLLM engine before interpreter teardown (its threads abort the process otherwise)
    if not stop:
        train.export_final(accelerator, actor.model, tokenizer, cfg.train.output_dir, total_steps)
        log.close(["teacher_kl", "eval/teacher_kl", "eval/reward_mean", "actor/entropy", "response_length/mean"])
    train.destroy(stop)  # after a stop signal: exits with 128 + its number


if __name__ == "__main__":
    main()
