"""Held-out evaluation maths as pure tensor functions: the unbiased pass@k of n samples per prompt."""

from __future__ import annotations

import torch


def pass_at_k(num_correct: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Unbiased pass@k of each prompt from n samples of which c passed (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without
    replacement hold at least one pass. Computed as their numerically stable product,
    C(n - c, k) / C(n, k) = prod_{i=0}^{k-1} (n - c - i) / (n - i), which is 0 once n - c < k.
    num_correct (P,) integers in [0, n] -> (P,) float64; 1 <= k <= n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} of {n} samples: need 1 <= k <= n")
    c = num_correct.double()[:, None]
    i = torch.arange(k, dtype=torch.float64)
    return 1.0 - ((n - c - i).clamp(min=0.0) / (n - i)).prod(-1)
