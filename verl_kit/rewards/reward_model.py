"""Training a reward model (recipes/reward_model.py): the classifier scored at every position, so that packed rows
give each sequence its reward at its own last token, the optional margin column, and held-out scoring. The trained
model is a plain HF AutoModelForSequenceClassification that rewards.RewardModel (PPO, GRPO) loads."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from verl_kit.config import BatchConfig
from verl_kit.data.packing import TokenBatch
from verl_kit.errors import UserError
from verl_kit.models.loading import pretrained, quantized, quiet_load, resolve_attn_implementation
from verl_kit.train.scoring import score_items


def margins(ds, source: str) -> torch.Tensor | None:
    """The optional `margin` column of a preference dataset (TRL's RewardTrainer reads it): (B,) float32, or None."""
    if "margin" not in ds.column_names:
        return None
    values = list(ds["margin"])
    for row_no, v in enumerate(values, start=1):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
            raise UserError(f"{source} row {row_no}: field 'margin' must be a finite number, got {v!r}")
    return torch.tensor(values, dtype=torch.float32)


def last_token_index(batch: TokenBatch, pad_id: int) -> torch.Tensor:
    """(N,) position, in the flattened (R*L) layout, of each sequence's last token that is not `pad_id`: where HF's
    sequence classifiers read the reward of a right-padded row (the rightmost non-pad token), found per sequence so
    that packed rows give the same rewards. With pad == EOS, a trailing EOS is skipped, as HF's forward skips it."""
    keep = ((batch.seq_ids >= 0) & (batch.input_ids != pad_id)).flatten()
    positions = torch.arange(keep.numel(), device=keep.device)
    out = torch.full((batch.num_seqs,), -1, dtype=torch.long, device=keep.device)
    out = out.scatter_reduce(0, batch.seq_ids.flatten()[keep], positions[keep], reduce="amax")
    if (out < 0).any():
        raise ValueError(f"sequence(s) {(out < 0).nonzero().flatten().tolist()} hold only pad tokens")
    return out


def sequence_rewards(values: torch.Tensor, batch: TokenBatch, pad_id: int) -> torch.Tensor:
    """Per-position rewards (R, L) -> each sequence's reward (N,), read at its last non-pad token."""
    return values.flatten()[last_token_index(batch, pad_id)]


class TokenRewardModel(nn.Module):
    """A sequence-classification reward model scored at every position: rewards (R, L) = score(backbone(tokens)).
    HF's own forward pools at the last non-pad token of each *row*, right for one sequence per row only; with the
    score at every position, sequence_rewards reads each packed sequence at its own end. `save_pretrained` writes the
    wrapped classifier, so export_hf writes a plain HF reward model (AutoModelForSequenceClassification)."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        if not isinstance(getattr(classifier, "score", None), nn.Linear):
            raise UserError(f"{type(classifier).__name__} has no linear `score` head; the reward model recipe reads "
                            "the reward from it at every position")
        self.classifier = classifier

    @property
    def config(self):
        return self.classifier.config

    def forward(self, input_ids, **kwargs) -> torch.Tensor:
        """input_ids (R, L) -> rewards (R, L) fp32; `kwargs`: the rest of TokenBatch.inputs() (attention_mask,
        position_ids, the packed segments), passed on to the backbone, without a KV cache."""
        from peft import PeftModel  # optional heavy dependency: imported where used, as in models.lora

        # with --use_peft the classifier is a PeftModel: its HF model's layers carry the adapter, `score` is trained
        hf = self.classifier.get_base_model() if isinstance(self.classifier, PeftModel) else self.classifier
        hidden = hf.base_model(input_ids=input_ids, **{**kwargs, "use_cache": False}).last_hidden_state
        return hf.score(hidden).squeeze(-1).float()

    def save_pretrained(self, path: str, state_dict: dict | None = None, **kwargs) -> None:
        if state_dict is not None:
            state_dict = {k.removeprefix("classifier."): v for k, v in state_dict.items()}
        self.classifier.save_pretrained(path, state_dict=state_dict, **kwargs)


def load_reward_classifier(path: str, pad_id: int, attn_implementation: str | None = None,
                           gradient_checkpointing: bool = False, load_in_4bit: bool = False) -> TokenRewardModel:
    """AutoModelForSequenceClassification with one label (a fresh `score` head on a causal LM checkpoint), fp32, its
    config's pad_token_id set so that HF's forward, and PPO's RewardModel, find the last real token."""
    with quiet_load():  # the load report lists the dropped lm_head and the new score head
        model = pretrained(AutoModelForSequenceClassification, path, num_labels=1, dtype=torch.float32,
                           attn_implementation=resolve_attn_implementation(attn_implementation),
                           **quantized(load_in_4bit))
    model.config.pad_token_id = pad_id
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return TokenRewardModel(model)


def score_rewards(accelerator, model, items: list, cfg: BatchConfig, pad_id: int, block_mask: bool,
                  desc: str = "rewards") -> torch.Tensor:
    """Rewards of every sequence of every item (scoring.Sequences): (n_items, k), on CPU, identical on all ranks,
    sharded in lockstep as scoring.score_items is."""
    return score_items(accelerator, model, items, cfg, pad_id, block_mask, desc, score_batch=lambda m, b: (
        sequence_rewards(m(**b.inputs()), b, pad_id)))
