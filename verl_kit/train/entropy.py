"""The entropy controls (algos.entropy, --entropy_coef, --use_adaptive_entropy, --top_entropy_quantile) in an online
recipe's update loop: which tokens the policy term acts on, the bonus term with its weights over those tokens on every
process, and the adaptive coefficient's update once per optimizer step. Off by default: then no term, no collective.

    ent.start()                                               # an optimizer step begins: its coefficient is fixed
    for chunk in actor.accumulate(update.chunks):
        acting, bonus = ent.terms(entropy, kept, n_tokens, len(update.chunks))
        if acting is not None: loss = loss * acting           # --top_entropy_quantile < 1
        objective = ... (+ bonus when it is not None)
    actor.step(); metrics.update(ent.end())                   # the adaptive update; entropy_coef
"""

from __future__ import annotations

import torch

from verl_kit.algos.entropy import high_entropy_mask
from verl_kit.config import EntropyConfig
from verl_kit.train.distributed import global_quantile, reduce_metrics


class EntropyTerms:
    """See the module docstring. `accelerator`: the adaptive coefficient's state is registered for checkpointing
    (accelerate's custom objects), so a resumed run applies the same coefficients."""

    def __init__(self, cfg: EntropyConfig, accelerator):
        self.control, self.rho = cfg.control(), cfg.top_entropy_quantile
        if self.control.adaptive:
            accelerator.register_for_checkpointing(self.control)
        self.coef, self.window = 0.0, torch.zeros(2, dtype=torch.float64)

    @property
    def enabled(self) -> bool:
        return self.control.enabled or self.rho < 1.0

    def start(self) -> None:
        self.coef, self.window = self.control.coefficient(), torch.zeros(2, dtype=torch.float64)

    def terms(self, entropy: torch.Tensor, kept: torch.Tensor | None, n_tokens: float, n_chunks: int
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For one micro-batch's tokens (M,): `entropy` (with its graph), `kept` (bool: the tokens the loss counts;
        None: all), `n_tokens` (kept tokens of the optimizer step on every process), `n_chunks` (its micro-batches) ->
        (the float mask of the tokens the policy term acts on, None for all: --top_entropy_quantile 1;
         the bonus, -coef * entropy * weight per token, None without a bonus), to add to the per-token objective
        reduced as global_mean_share(objective, 1.0, world). The weights make the bonus the mean entropy of the
        acting tokens: the step's kept tokens on every process (1 / n_tokens each), or, with a quantile, TRL's
        mean over each micro-batch's acting tokens (every process) divided by the micro-batches. Collective with
        --top_entropy_quantile < 1 (the quantile and the count; every process runs the same micro-batches)."""
        if not self.enabled:
            return None, None
        kept = torch.ones_like(entropy, dtype=torch.bool) if kept is None else kept.bool()
        acting = kept
        if self.rho < 1.0:
            threshold = global_quantile(entropy.detach()[kept], 1.0 - self.rho)
            acting = kept & high_entropy_mask(entropy.detach(), threshold)
            count = reduce_metrics({"n": acting.sum()})["n"]
            weight = acting.float() / max(count * n_chunks, 1.0)
        else:
            weight = acting.float() / max(n_tokens, 1.0)
        self.window += torch.stack([(entropy.detach().double() * acting).sum(), acting.sum().double()]).cpu()
        bonus = -self.coef * entropy * weight if self.control.enabled else None
        return (acting.float() if self.rho < 1.0 else None), bonus

    def end(self) -> dict:
        """The optimizer step is done: an adaptive coefficient moves by the step's entropy over the acting tokens of
        every micro-batch and process (a collective, adaptive only). Returns {entropy_coef} with a bonus."""
        if self.control.adaptive:
            t = reduce_metrics({"entropy": float(self.window[0]), "tokens": float(self.window[1])})
            self.control.update(t["entropy"] / max(t["tokens"], 1.0))
        return {"entropy_coef": self.control.coef} if self.control.enabled else {}
