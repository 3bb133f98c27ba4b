"""The difficulty curriculum (verl_kit.rollout.curriculum, `--curriculum difficulty`) by hand: the weights of its
pools, the solve rates it records, a seeded draw that is the same on every process and split across them, a draw
whose frequencies follow the weights, and its state round trip. A 2-process ZeRO-3 GRPO run drawing by it resumes
bit-identically: tests/recipes/test_grpo_runs.py::test_grpo_zero3_two_processes_resume_bit_identical."""

import math

import pytest
import torch

from verl_kit.config import RolloutConfig
from verl_kit.errors import UserError
from verl_kit.rollout.curriculum import DifficultyCurriculum, pool_weights


def test_pools_and_solve_rates():
    """Never drawn (NaN) and partly solved: weight 1; solved by every sample: easy; by none: hard. A batch's samples
    set each drawn prompt's rate to the share that passed (score >= the threshold) in that batch; prompts not in it
    keep theirs."""
    solve = torch.tensor([float("nan"), 1.0, 0.0, 0.5], dtype=torch.float64)
    assert pool_weights(solve, 0.1, 0.3).tolist() == [1.0, 0.1, 0.3, 1.0]
    c = DifficultyCurriculum(5, 0.1, 0.1, pass_threshold=0.5)
    c.observe([0, 0, 0, 0, 1, 1, 3, 3], torch.tensor([1.0, 0.5, 0.2, 0.0, 0.9, 0.6, 0.0, 0.1]))
    assert c.solve[0] == 0.5 and c.solve[1] == 1.0 and math.isnan(c.solve[2]) and c.solve[3] == 0.0
    c.observe([3], torch.tensor([0.7]))
    assert c.solve[3] == 1.0 and c.solve[1] == 1.0  # 3 re-drawn, 1 not: it keeps its rate
    assert c.metrics() == {"curriculum/seen": 3 / 5, "curriculum/easy": 2 / 5, "curriculum/hard": 0.0}
    state = c.state_dict()
    d = DifficultyCurriculum(5, 0.1, 0.1, 0.5)
    d.load_state_dict(state)
    assert torch.equal(d.solve.nan_to_num(-1), c.solve.nan_to_num(-1))
    with pytest.raises(ValueError, match="curriculum state for 5 prompts, the split has 4"):
        DifficultyCurriculum(4, 0.1, 0.1, 0.5).load_state_dict(state)


def test_draw_is_seeded_split_across_processes_and_follows_the_weights():
    """A step's draw is a pure function of (seed, step) and the table: the same on every process, which take
    contiguous slices of it (distinct prompts, together the whole draw). Over many steps, single draws land on each
    prompt in proportion to its weight (1, 0.1, 0.3, 1 -> 1/2.4, ...: within 2.5 points over 4000 draws)."""
    c = DifficultyCurriculum(10, 0.1, 0.3, 1.0)
    c.solve[:] = torch.tensor([float("nan"), 1, 0, 0.5, 1, 1, 0, 0, 0.5, float("nan")], dtype=torch.float64)
    whole = c.indices(3, 8, seed=42, rank=0, world=1)
    parts = [c.indices(3, 8, seed=42, rank=r, world=2) for r in (0, 1)]
    assert parts[0] + parts[1] == whole and len(set(whole)) == 8
    assert c.indices(3, 8, 42, 0, 1) == whole and c.indices(4, 8, 42, 0, 1) != whole
    c = DifficultyCurriculum(4, 0.1, 0.3, 1.0)
    c.solve[:] = torch.tensor([float("nan"), 1, 0, 0.5], dtype=torch.float64)
    counts = torch.bincount(torch.tensor([c.indices(s, 1, 7, 0, 1)[0] for s in range(4000)]), minlength=4)
    expected = torch.tensor([1, 0.1, 0.3, 1]) / 2.4
    assert torch.allclose(counts / 4000, expected, atol=0.025), counts / 4000
    assert sorted(DifficultyCurriculum(3, 0.1, 0.1, 1.0).indices(0, 5, 1, 0, 1)[:3]) == [0, 1, 2]  # more than n


def test_curriculum_flags():
    for flag in ("--curriculum_easy_weight", "--curriculum_hard_weight"):
        with pytest.raises(UserError, match=f"{flag} 0.0: use a positive weight"):
            RolloutConfig(**{flag[2:]: 0.0})
    with pytest.raises(UserError, match="--curriculum: 'hard' is not one of none, difficulty"):
        RolloutConfig(curriculum="hard")
