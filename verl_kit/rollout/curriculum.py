"""A difficulty curriculum for the online recipes (`--curriculum difficulty`): prompts are drawn by how the policy did
on them last time, so steps are spent on prompts that still teach something. Dynamic sampling (`--dynamic_sampling`)
drops solved and hopeless groups after paying to generate them; this draws them less in the first place (prime-rl's
DifficultyPoolSampler; marin#8765: MATH500 0.434 vs 0.362 on Qwen3-0.6B for the same tokens).

The rule. Each prompt's solve rate is the share of its samples that passed (score >= --pass_threshold) the last time
it was drawn; a prompt never drawn has none. A step draws `prompts_per_step` distinct prompts (over all processes)
with probability proportional to a weight: 1 for prompts never drawn or partly solved, `--curriculum_easy_weight` for
those solved by every sample, `--curriculum_hard_weight` for those solved by none (torch.multinomial without
replacement, seeded by the step: the same draw on every process, then split contiguously across processes as
train.step_indices does). Every process observes every process's results (one all-reduce per batch), so the table is
the same everywhere; it is saved in each checkpoint (a resumed run draws the same prompts). With --async_rollout a
batch is drawn before the previous step's scores are in: the table lags by the batches generated ahead.
"""

from __future__ import annotations

import torch

from verl_kit.train.distributed import all_reduce_sum, derived_seed


def pool_weights(solve: torch.Tensor, easy_weight: float, hard_weight: float) -> torch.Tensor:
    """(N,) draw weights from (N,) solve rates (NaN: never drawn): easy_weight where 1, hard_weight where 0, else 1."""
    w = torch.ones_like(solve, dtype=torch.float64)
    w[solve == 1] = easy_weight
    w[solve == 0] = hard_weight
    return w


class DifficultyCurriculum:
    """The solve-rate table of `n` prompts and the draw it drives (module docstring)."""

    def __init__(self, n: int, easy_weight: float, hard_weight: float, pass_threshold: float):
        self.solve = torch.full((n,), float("nan"), dtype=torch.float64)
        self.easy_weight, self.hard_weight, self.pass_threshold = easy_weight, hard_weight, pass_threshold

    def indices(self, step: int, per_step: int, seed: int, rank: int, world: int) -> list[int]:
        """This process's prompts of step `step` (per_step over all processes), drawn from the table as it is."""
        w = pool_weights(self.solve, self.easy_weight, self.hard_weight)
        g = torch.Generator().manual_seed(derived_seed(seed, step, 7919))
        if per_step > len(w):  # more prompts per step than the split has: every prompt, in a seeded order
            drawn = torch.cat([torch.randperm(len(w), generator=g)] * -(-per_step // len(w)))[:per_step]
        else:
            drawn = torch.multinomial(w, per_step, replacement=False, generator=g)
        k = per_step // world
        return drawn[rank * k:(rank + 1) * k].tolist()

    def observe(self, prompt_index: list[int], scores: torch.Tensor) -> None:
        """Record a batch's results on every process (collective: each calls it once per batch): each drawn prompt's
        solve rate becomes the share of its samples (episodes, `scores` (E,) aligned with `prompt_index`) that passed
        in this batch, over all processes."""
        n = len(self.solve)
        counts = torch.zeros(2, n, dtype=torch.float64)
        idx = torch.as_tensor(prompt_index, dtype=torch.long)
        counts[0].index_add_(0, idx, torch.ones(len(idx), dtype=torch.float64))
        counts[1].index_add_(0, idx, (scores.double() >= self.pass_threshold).double())
        counts = all_reduce_sum(counts)
        seen = counts[0] > 0
        self.solve[seen] = counts[1][seen] / counts[0][seen]

    def metrics(self) -> dict[str, float]:
        """curriculum/seen, curriculum/easy, curriculum/hard: shares of the split's prompts drawn at least once, last
        solved by every sample, by none."""
        n = max(len(self.solve), 1)
        return {"curriculum/seen": (~self.solve.isnan()).sum().item() / n,
                "curriculum/easy": (self.solve == 1).sum().item() / n,
                "curriculum/hard": (self.solve == 0).sum().item() / n}

    def state_dict(self) -> dict:
        return {"solve": self.solve.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["solve"].shape != self.solve.shape:
            raise ValueError(f"curriculum state for {len(state['solve'])} prompts, the split has {len(self.solve)}")
        self.solve = state["solve"].clone().double()
