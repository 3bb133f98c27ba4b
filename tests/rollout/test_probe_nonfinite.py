"""The probe treats a non-finite log-prob as a failure (issue 39, item 2): NaN compares false with any bound, so a
`diff > bound` check let an engine (or a trainer) whose weights had turned NaN through, whatever the bound."""

import math

import pytest
import torch

from verl_kit.rollout.probe import Probe, max_abs_diff


def test_max_abs_diff_keeps_a_nan_wherever_it_stands():
    """Python's max() keeps a NaN only when it comes first; torch's reduction keeps it anywhere."""
    ok, bad = [torch.zeros(3)], [torch.tensor([0.0, math.nan, 0.0])]
    assert math.isnan(max_abs_diff(ok + bad, ok + ok)) and math.isnan(max_abs_diff(bad + ok, ok + ok))
    assert max_abs_diff([torch.tensor([1.0, -2.0])], [torch.zeros(2)]) == 2.0


@pytest.mark.parametrize("threshold", [1e-3, math.inf])
def test_a_nan_engine_fails_the_probe_whatever_the_bound(tiny_model_path, threshold):
    """The tiny model's trainer log-probs against an engine that returns them with one NaN: the probe stops the run,
    naming the engine's side, with the fp32 bound and with an infinite one; the same log-probs pass."""
    from verl_kit.models import load_causal_lm
    from verl_kit.rollout.probe import trainer_logprobs

    model = load_causal_lm(tiny_model_path)
    seqs = [[1, 5, 9, 13], [2, 6, 10]]
    honest = trainer_logprobs(model, seqs)
    Probe(seqs, threshold).check(lambda s: honest, model, scores_here=True)

    def broken(s):
        out = [x.clone() for x in honest]
        out[1][-1] = math.nan
        return out

    with pytest.raises(RuntimeError, match=r"^the probe's log-probs are not finite \(the engine's; "):
        Probe(seqs, threshold).check(broken, model, scores_here=True)
