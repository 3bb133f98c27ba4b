"""verl_kit.algos.evaluation by hand: the unbiased pass@k."""

import math

import pytest
import torch

from verl_kit.algos import pass_at_k


def test_pass_at_k_by_hand():
    """n = 4 samples, c = [0, 1, 2, 4] passed. pass@1 = c / n = [0, 0.25, 0.5, 1].
    pass@2 = 1 - C(4 - c, 2) / C(4, 2), C(4, 2) = 6: c=0 -> 1 - 6/6 = 0; c=1 -> 1 - 3/6 = 0.5; c=2 -> 1 - 1/6 =
    0.833333; c=4 -> C(0, 2) = 0 -> 1. pass@4: any pass among all four -> [0, 1, 1, 1]. And against math.comb on every
    (n, c, k) up to n = 9."""
    c = torch.tensor([0, 1, 2, 4])
    torch.testing.assert_close(pass_at_k(c, 4, 1), torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(c, 4, 2), torch.tensor([0.0, 0.5, 5 / 6, 1.0], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(c, 4, 4), torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    for n in range(1, 10):
        for k in range(1, n + 1):
            cs = torch.arange(n + 1)
            want = [1 - math.comb(n - int(x), k) / math.comb(n, k) for x in cs]
            torch.testing.assert_close(pass_at_k(cs, n, k), torch.tensor(want, dtype=torch.float64))
    with pytest.raises(ValueError, match="pass@5 of 4"):
        pass_at_k(c, 4, 5)
