"""PPO's models beyond the policy, and the forward passes over packed responses that actor, critic and reference share.

actor      the policy LM, trained                       train.Trainable
critic     LM backbone + scalar value head, trained     CriticModel in a Trainable of its own
reference  the initial policy, frozen                   train.frozen
reward     HF sequence-classifier, frozen (optional)    train.frozen, wrapped by rewards.RewardModel

Why the critic is a second Trainable and not one engine over a module holding both (TRL's old PolicyAndValueWrapper):
one engine shares one optimizer, one clipping norm and one step, so critic gradients, often much larger, would shrink
the actor's clipped update, and the two could not be stepped or measured (grad norm) apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from verl_kit.algos.off_policy import importance_weights, mismatch_metrics
from verl_kit.config import BatchConfig, RatioConfig, RolloutBackendFacts
from verl_kit.data.packing import TokenBatch, layout
from verl_kit.models.loading import pretrained, quiet_load, resolve_attn_implementation, uses_block_mask
from verl_kit.train.lm_head import head_divergence, head_logprobs, scored_logits


class CriticModel(nn.Module):
    """values (R, L) = value_head(backbone(tokens)): a transformer without LM head and a linear map to a scalar."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.backbone, self.value_head = backbone, value_head

    @classmethod
    def from_pretrained(cls, path: str, init: str, attn_implementation: str | None, gradient_checkpointing: bool):
        """init='policy': the policy's backbone (AutoModel drops the LM head) and a zero value head, so every value
        starts at 0. init='reward': a sequence-classification reward model's backbone and its score head.
        `attn_implementation` as the kit resolves it (models.loading.resolve_attn_implementation)."""
        from transformers import AutoModel, AutoModelForSequenceClassification

        attn_implementation = resolve_attn_implementation(attn_implementation)
        if init == "policy":
            with quiet_load():  # the load report would flag the dropped lm_head as "UNEXPECTED"
                backbone = pretrained(AutoModel, path, dtype=torch.float32, attn_implementation=attn_implementation)
            head = nn.Linear(backbone.config.hidden_size, 1, bias=True)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        else:
            rm = pretrained(AutoModelForSequenceClassification, path, num_labels=1, dtype=torch.float32,
                            attn_implementation=attn_implementation)
            backbone, head = rm.base_model, getattr(rm, "score", None)
            if not isinstance(head, nn.Linear):
                raise ValueError(f"{path}: the reward model has no linear `score` head to initialise the value head")
        backbone.config.use_cache = False
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return cls(backbone, head)

    def forward(self, input_ids, **kwargs) -> torch.Tensor:
        """input_ids (R, L) -> values (R, L) fp32; `kwargs`: the rest of TokenBatch.inputs() (attention_mask,
        position_ids, the packed segments), passed on to the backbone, without a KV cache."""
        hidden = self.backbone(input_ids=input_ids, **{**kwargs, "use_cache": False}).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


# ---- forward passes over packed responses -----------------------------------------------------------------------


@dataclass
class ResponseIndex:
    """Where the M scored (response) tokens of a packed TokenBatch come from. Fields:
    scored   (rows, L-1) bool  position predicts a response token (logits[:, :-1][scored] are its logits)
    targets  (M,) long         the response tokens
    row      (M,) long         their rollout row (index into the (B, R) response tensors)
    pos      (M,) long         their position in the response
    """

    scored: torch.Tensor
    targets: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor

    def gather(self, values: torch.Tensor, device=None) -> torch.Tensor:
        """The micro-batch's (M,) slice of a rollout tensor: per response (B,) -> each token's response's value, per
        token (B, R) -> each token's own value; on `device`."""
        out = values[self.row] if values.dim() == 1 else values[self.row, self.pos]
        return out if device is None else out.to(device)


def same_tokens(mine: ResponseIndex, theirs: ResponseIndex) -> torch.Tensor:
    """(M,) the order that takes `theirs`' scored tokens to `mine`'s: the same (row, position) of one rollout's
    responses, packed into two layouts (different prompts before them)."""
    width = int(max(mine.pos.max(), theirs.pos.max())) + 1 if len(mine.pos) else 1
    key_mine, key_theirs = mine.row * width + mine.pos, theirs.row * width + theirs.pos
    return torch.argsort(key_theirs)[torch.argsort(torch.argsort(key_mine))]


def pack_responses(prompt_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor,
                   rows: list[int], pad_id: int, packing: bool, packing_length: int,
                   block_mask: bool, hidden_size: int | None = None,
                   env_mask: torch.Tensor | None = None) -> tuple[TokenBatch, ResponseIndex]:
    """prompt + response of each rollout row in `rows`, packed (or padded, see packing.layout), response tokens
    scored; rows with the same prompt (a GRPO group) share one copy of it where that costs less (layout's
    shared_prefix). `env_mask` (multi-turn episodes): tokens the environment inserted, in the sequence, not scored."""
    whole = response_mask if env_mask is None else response_mask | env_mask
    lengths = whole.sum(-1).tolist()
    seqs = [prompt_ids[i] + response_ids[i, :lengths[i]].tolist() for i in rows]
    masks = [[False] * len(prompt_ids[i]) + response_mask[i, :lengths[i]].tolist() for i in rows]
    batch = layout(seqs, masks, pad_id, packing=packing, packing_length=packing_length, block_mask=block_mask,
                   hidden_size=hidden_size, shared_prefix=[len(prompt_ids[i]) - 1 for i in rows])
    scored = batch.scored
    local = batch.seq_ids[:, 1:][scored]
    prompt_len = torch.tensor([len(prompt_ids[i]) for i in rows])
    pos = batch.position_ids[:, 1:][scored] - prompt_len[local]
    return batch, ResponseIndex(scored, batch.input_ids[:, 1:][scored], torch.tensor(rows)[local], pos)


def actor_logits(model, batch: TokenBatch, index: ResponseIndex, temperature: float) -> torch.Tensor:
    """Logits (M, V) of the response tokens, divided by the sampling temperature so that log-probs are those of
    the distribution the tokens were sampled from. The LM head runs on the M positions that predict a response
    token only, not on prompt, environment or padding positions (a hook on the output layer selects them first;
    the full (R, L, V) logits are what a 49k vocabulary makes the largest tensor of a step). Whole logits only for a
    loss that needs them: log-probs and entropy go through lm_head.head_logprobs, in chunks."""
    return scored_logits(model, batch.inputs(), index.scored.to(batch.input_ids.device)) / temperature


def critic_values(critic, batch: TokenBatch, index: ResponseIndex) -> torch.Tensor:
    """V(s_t) (M,) for each response token t, read at the position that predicts it (the state before the token)."""
    values = critic(**batch.inputs())
    return values[:, :-1][index.scored]


class ResponsePacker:
    """Packs rollout rows for the forward passes of actor, critic and reference, the layout fitted to the policy
    (block mask unless flash-attention; pack or pad by cost, packing.layout) and the packing flags of a BatchConfig."""

    def __init__(self, cfg: BatchConfig, pad_id: int, model, temperature: float = 1.0):
        self.cfg, self.pad_id, self.temperature = cfg, pad_id, temperature
        self.block_mask = uses_block_mask(model)
        self.hidden_size = model.config.hidden_size

    def __call__(self, rollout, rows: list[int]) -> tuple[TokenBatch, ResponseIndex]:
        return pack_responses(rollout.prompt_ids, rollout.response_ids, rollout.response_mask, rows, self.pad_id,
                              self.cfg.packing, self.cfg.packing_length, self.block_mask, self.hidden_size,
                              rollout.env_mask)

    def forward(self, model, rollout, rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor, ResponseIndex]:
        """`model`'s log-probs (M,) and entropy (M,) at the sampling temperature of the response tokens of rollout
        `rows` (one micro-batch), and where each token comes from; through the LM head in chunks (lm_head), never the
        (M, V) logits. A frozen model's (a teacher's) build no graph."""
        batch, index = self(rollout, rows)
        trained = any(p.requires_grad for p in model.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and trained):
            batch = batch.to(device)
            logprobs, entropy = head_logprobs(model, batch.inputs(), index.scored, index.targets, self.temperature)
            return logprobs, entropy, index

    def divergence(self, model, teacher, rollout, rows: list[int], device, beta: float,
                   teacher_rollout=None) -> tuple[torch.Tensor, ...]:
        """Distillation's scores of the response tokens of rollout `rows` at the sampling temperature, through both
        LM heads in chunks (lm_head.head_divergence): the student `model`'s log-probs, entropy and generalized JSD
        from the frozen `teacher` (algos.generalized_jsd, `beta`), the teacher's log-probs, each (M,), and where each
        token comes from. `teacher_rollout`: the same responses after the prompts the teacher reads
        (self-distillation's privileged context), packed on their own and matched token by token."""
        batch, index = self(rollout, rows)
        batch = batch.to(device)
        theirs = None
        if teacher_rollout is not None and teacher_rollout is not rollout:
            t_batch, t_index = self(teacher_rollout, rows)
            theirs = (t_batch.to(device).inputs(), t_index.scored, same_tokens(index, t_index))
        return (*head_divergence(model, teacher, batch.inputs(), index.scored, index.targets, self.temperature, beta,
                                 teacher_inputs=theirs), index)

    def logprobs(self, model, rollout, chunks: list[list[int]], device) -> torch.Tensor:
        """(B, R) log-probs of every response token under `model` at the sampling temperature."""
        return self.per_token(lambda b, ix: head_logprobs(model, b.inputs(), ix.scored, ix.targets,
                                                          self.temperature)[0], rollout, chunks, device)

    def old_logprobs(self, model, rollout, chunks: list[list[int]], device, source: str) -> torch.Tensor:
        """(B, R) pi_old, the policy the updates' ratio is taken against (--old_logprobs): `model`'s log-probs before
        the step's first update ("recompute"), or the engine's sampling log-probs ("rollout")."""
        return rollout.sampling_logprobs if source == "rollout" else self.logprobs(model, rollout, chunks, device)

    @torch.no_grad()
    def per_token(self, fn: Callable[[TokenBatch, ResponseIndex], torch.Tensor], rollout, chunks: list[list[int]],
                  device) -> torch.Tensor:
        """(B, R) float32 on CPU of `fn(batch, index) -> (M,)` over every rollout row, micro-batch by micro-batch
        (`chunks` of row indices); 0 outside the responses."""
        out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32)
        for rows in chunks:
            batch, index = self(rollout, rows)
            out[index.row, index.pos] = fn(batch.to(device), index).float().cpu()
        return out


class OffPolicyCorrection:
    """The engine sampled from mu, not from the trainer's pi_old (a vLLM engine's numerics; a one-step-off batch):
    each token's loss is weighted by pi_old / mu (algos.off_policy.importance_weights, --vllm_importance_sampling_*)
    and the mismatch measured (algos.off_policy.mismatch_metrics), as `cfg` (--vllm_importance_sampling_*) says for
    the `backend` (RolloutConfig.backend, the facts of --rollout): not for HF generate, which samples with the
    trainer's numerics."""

    def __init__(self, cfg: RatioConfig, backend: RolloutBackendFacts):
        self.on, self.args = cfg.importance_sampling(backend), cfg.importance_sampling_args()

    def __call__(self, loss: torch.Tensor, old: torch.Tensor, ro, ix: ResponseIndex, device, tally,
                 measure: bool) -> torch.Tensor:
        """`loss` (M,) of a micro-batch's tokens `ix` of rollout `ro`, weighted; `old` (M,) their pi_old log-probs;
        with `measure` (the first pass over a batch) the mismatch metrics go into `tally`."""
        if not self.on:
            return loss
        terms = (old, ix.gather(ro.sampling_logprobs, device), ix.row.to(device), len(ro.prompt_ids))
        if measure:
            tally.add(**mismatch_metrics(*terms, **self.args))
        return loss * importance_weights(*terms, **self.args)
