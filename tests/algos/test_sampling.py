"""verl_kit.algos.sampling by hand: DAPO's informative (not flat) groups and the ones a step keeps. (The rollouts
refilling a step's batch with them: tests/rollout/test_rollouts.py.)"""

import pytest
import torch

from verl_kit.algos import group_rows, informative_groups, select_groups


def test_informative_groups_and_selection_by_hand():
    """Groups of 2 (float64): [1, 1] flat; [0, 1] informative; [0.5, 0.5 + 1e-12] informative (exact equality: the
    difference is tiny but real, and the advantages use it); [0.0, -0.0] flat (equal numbers); [3, 3] flat.
    Selection from informative = [F, T, T, F, F] for a step of target 2: take 2 -> groups [1, 2], rows [2, 3, 4, 5];
    take 1 (the fewest any process found) -> [1]; take 0 (some process found none) -> the first batch's groups
    [0, 1] as they are."""
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-12, 0.0, -0.0, 3.0, 3.0], dtype=torch.float64)
    informative = informative_groups(scores, 2)
    assert informative.tolist() == [False, True, True, False, False]
    assert select_groups(informative, 2, 2).tolist() == [1, 2]
    assert group_rows(select_groups(informative, 2, 2), 2).tolist() == [2, 3, 4, 5]
    assert select_groups(informative, 2, 1).tolist() == [1]
    assert select_groups(informative, 2, 0).tolist() == [0, 1]
    with pytest.raises(ValueError, match="only 2 informative"):
        select_groups(informative, 3, 3)
