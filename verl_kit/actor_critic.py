"""The four PPO models and their forward passes over packed responses.

actor      the policy LM, trained                       Trainable (own optimizer, LR schedule, DeepSpeed engine)
critic     LM backbone + scalar value head, trained     CriticModel in a Trainable of its own
reference  the initial policy, frozen                   frozen(): a ZeRO-3 inference engine, or a plain module
reward     HF sequence-classifier, frozen (optional)    frozen(), wrapped by rewards.RewardModel

Two trainable models under ZeRO-3: one DeepSpeed engine per model, each made by its own `accelerator.prepare(model,
optimizer)` call with the same DeepSpeed plugin. Why this and not the alternatives:
  - one engine over a module holding both (TRL's old PolicyAndValueWrapper) shares one optimizer, one gradient
    clipping norm and one step: critic gradients, often much larger, would shrink the actor's clipped update, and the
    two could not be stepped or measured (grad norm) apart;
  - accelerate's multiple DeepSpeed plugins let each model have its own DeepSpeed config, which is not needed here
    (the same ZeRO stage for both) and adds a `select_deepspeed_plugin` call before every use.
With two prepare calls, accelerate's save_state/load_state already checkpoint every prepared engine (pytorch_model,
pytorch_model_1) with its optimizer. One catch (accelerate 1.15, Accelerator.backward): every loss goes to the engine
prepared first, so Trainable drives each engine through DeepSpeed's public backward/step instead.
Frozen models are sharded with ZeRO-3 too (inference engines without optimizer, as TRL's prepare_deepspeed does), so
the reference and reward models cost 1/world of their size per process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from verl_kit.distributed import micro_step, zero_stage
from verl_kit.packing import TokenBatch, layout


class CriticModel(nn.Module):
    """values (R, L) = value_head(backbone(tokens)): a transformer without LM head and a linear map to a scalar."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.backbone, self.value_head = backbone, value_head

    @classmethod
    def from_pretrained(cls, path: str, init: str, attn_implementation: str, gradient_checkpointing: bool):
        """init='policy': the policy's backbone (AutoModel drops the LM head) and a zero value head, so every value
        starts at 0. init='reward': a sequence-classification reward model's backbone and its score head."""
        from transformers import AutoModel, AutoModelForSequenceClassification

        if init == "policy":
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the load report would flag the dropped lm_head as "UNEXPECTED"
            try:
                backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
            finally:
                hf_logging.set_verbosity(verbosity)
            head = nn.Linear(backbone.config.hidden_size, 1, bias=True)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        else:
            rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                    attn_implementation=attn_implementation)
            backbone, head = rm.base_model, getattr(rm, "score", None)
            if not isinstance(head, nn.Linear):
                raise ValueError(f"{path}: the reward model has no linear `score` head to initialise the value head")
        backbone.config.use_cache = False
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return cls(backbone, head)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def frozen(accelerator, loader):
    """Build a frozen model with `loader()` and place it: under ZeRO-3 a DeepSpeed inference engine over its shards
    (every process must then run the same number of forward passes), otherwise a plain module on the device."""
    if zero_stage(accelerator) == 3:
        import deepspeed

        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": 1, "bf16": copy.deepcopy(ds.get("bf16", {"enabled": False}))}
        model = loader()
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval() returns None
        return engine
    return loader().to(accelerator.device).requires_grad_(False).eval()


class Trainable:
    """A model prepared with its own optimizer and LR schedule (its own DeepSpeed engine under DeepSpeed).
    backward() once per micro-batch, then step() once per minibatch."""

    def __init__(self, accelerator, model: nn.Module, learning_rate: float, weight_decay: float, scheduler_type: str,
                 warmup_steps: int, total_steps: int, max_grad_norm: float):
        from transformers import get_scheduler

        self.accelerator, self.max_grad_norm = accelerator, max_grad_norm
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
        self.scheduler = get_scheduler(scheduler_type, optimizer, warmup_steps, total_steps)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)  # stepped by hand, once per PPO step
        self.deepspeed = accelerator.distributed_type.value == "DEEPSPEED"

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate gradients; on the last micro-batch of a minibatch they are reduced over processes (and under
        DeepSpeed the engine clips and steps, as its gradient-accumulation boundary)."""
        if self.deepspeed:
            self.model.set_gradient_accumulation_boundary(last)
            self.model.backward(loss)
            if last:
                self.model.step()
        else:
            with micro_step(self.accelerator, self.model, last):
                self.accelerator.backward(loss)

    def step(self) -> float:
        """Apply the accumulated update (clipped to max_grad_norm); returns the gradient norm before clipping."""
        if self.deepspeed:
            norm = self.model.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm


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


def pack_responses(prompt_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor,
                   rows: list[int], pad_id: int, packing: bool, packing_length: int,
                   block_mask: bool, hidden_size: int | None = None) -> tuple[TokenBatch, ResponseIndex]:
    """prompt + response of each rollout row in `rows`, packed (or padded, see packing.layout), response tokens
    scored."""
    lengths = response_mask.sum(-1).tolist()
    seqs = [prompt_ids[i] + response_ids[i, :lengths[i]].tolist() for i in rows]
    masks = [[False] * len(prompt_ids[i]) + [True] * lengths[i] for i in rows]
    batch = layout(seqs, masks, pad_id, packing=packing, packing_length=packing_length, block_mask=block_mask,
                   hidden_size=hidden_size)
    scored = batch.loss_mask[:, 1:] & (batch.seq_ids[:, 1:] == batch.seq_ids[:, :-1])
    local = batch.seq_ids[:, 1:][scored]
    prompt_len = torch.tensor([len(prompt_ids[i]) for i in rows])
    pos = batch.position_ids[:, 1:][scored] - prompt_len[local]
    return batch, ResponseIndex(scored, batch.input_ids[:, 1:][scored], torch.tensor(rows)[local], pos)


def actor_logits(model, batch: TokenBatch, index: ResponseIndex, temperature: float) -> torch.Tensor:
    """Logits (M, V) of the response tokens, divided by the sampling temperature so that log-probs are those of
    the distribution the tokens were sampled from."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False).logits
    return logits[:, :-1][index.scored].float() / temperature


def critic_values(critic, batch: TokenBatch, index: ResponseIndex) -> torch.Tensor:
    """V(s_t) (M,) for each response token t, read at the position that predicts it (the state before the token)."""
    values = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    return values[:, :-1][index.scored]
