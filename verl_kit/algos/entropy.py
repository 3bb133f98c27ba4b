"""Entropy controls (TRL 1.16's GRPOConfig names and semantics): an entropy bonus with a fixed or adaptive coefficient,
and training the policy term on the high-entropy tokens only. Pure maths and a small controller; no model, no
accelerator.

    --entropy_coef c            loss = policy loss - c * H, H the mean entropy of the tokens the loss acts on
    --use_adaptive_entropy      Skywork-OR1 (arXiv 2505.22312): after each optimizer step c moves by
                                --entropy_coef_delta toward more bonus when the step's entropy was at or below
                                --entropy_target and toward less otherwise, within [--entropy_coef_min, _max]; the bonus
                                applies only in a step whose previous step's entropy was at or below the target (none
                                in the first step)
    --top_entropy_quantile rho  "Beyond the 80/20 rule" (arXiv 2506.01939): the policy term keeps only tokens whose
                                entropy is at or above the (1 - rho) quantile of the micro-batch's tokens on every
                                process (0: the highest only; 1: all); the bonus acts on the same tokens
"""

from __future__ import annotations

import math

import torch


def high_entropy_mask(entropy: torch.Tensor, threshold: float) -> torch.Tensor:
    """(M,) bool: the tokens whose entropy is at least `threshold` (the (1 - rho) quantile of the tokens considered,
    over every process: train.global_quantile)."""
    return entropy >= threshold


class EntropyControl:
    """The entropy bonus's coefficient through a run (see the module docstring). `coefficient()` is the one every
    micro-batch of the coming optimizer step applies; `update(entropy)` takes that step's entropy (the token mean over
    the tokens the loss acted on, every micro-batch and process) and moves an adaptive coefficient. Its state goes in
    the checkpoint (state_dict), so a resumed run applies the same coefficients."""

    def __init__(self, coef: float = 0.0, adaptive: bool = False, coef_min: float = 0.0, coef_max: float = 1.0,
                 delta: float = 0.005, target: float = 0.2):
        self.coef, self.adaptive = coef, adaptive
        self.coef_min, self.coef_max, self.delta, self.target = coef_min, coef_max, delta, target
        self.last_entropy = math.inf  # no measurement yet: no adaptive bonus in the first step

    @property
    def enabled(self) -> bool:
        """Whether the loss has a bonus term at all (adaptive: even while its coefficient sits at 0)."""
        return self.coef != 0.0 or self.adaptive

    def coefficient(self) -> float:
        if self.adaptive:
            return self.coef if self.last_entropy <= self.target else 0.0
        return self.coef

    def update(self, entropy: float) -> None:
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
