"""Which groups a step trains on, as pure tensor functions: DAPO's dynamic sampling (Yu et al. 2025, section 3.2,
eq. 11: 0 < |{o_i correct}| < G), which keeps only the groups whose responses did not all score the same, since a
group of equal scores has zero group-relative advantage and teaches nothing.

Shapes: B = G * n responses, n per group on consecutive rows (the rollout's order)."""

from __future__ import annotations

import torch


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """scores (B,) -> (G,) bool: True for a group whose scores are not all equal. Exact equality, not a tolerance: a
    group of 0/1 rewards is flat only when every score is the same number, and a float difference however small is
    a signal the advantages use (a tolerance would drop it, or keep flat groups that float noise split)."""
    groups = scores.view(-1, group_size)
    return (groups != groups[:, :1]).any(-1)


def select_groups(informative: torch.Tensor, target: int, take: int) -> torch.Tensor:
    """The groups a step trains on, as indices into the generated groups (G,) bool, in generation order: the first
    `take` informative ones (`take` <= target: the count every process can keep, so all train on as many rows);
    when `take` is 0 (no process found one), the first `target` groups as they are (the step's first batch: flat
    groups teach nothing, but the step keeps its shape). -> (take,) or (target,) long."""
    if take == 0:
        return torch.arange(target)
    found = informative.nonzero().flatten()
    if len(found) < take:
        raise ValueError(f"take {take} groups: only {len(found)} informative ones were generated")
    return found[:take]


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group indices (K,) -> the indices of their responses (K * n,), each group's n rows in order."""
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()
