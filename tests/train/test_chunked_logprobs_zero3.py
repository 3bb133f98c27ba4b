"""The chunked LM head under ZeRO-3 x2 (real DeepSpeed, gloo over loopback): each process's log-probs, entropy and
the gathered gradients of the output layer and the embedding equal one process through the whole logits, so the
partitioned head weight is gathered for the chunked forward and backward (tests/train/chunked_logprobs_worker.py)."""

import json
import sys

import pytest
import torch
from helpers import REPO, launch_script, run

pytestmark = pytest.mark.slow

WORKER = str(REPO / "tests" / "train" / "chunked_logprobs_worker.py")
TOL = 1e-5  # relative, fp32


def _run(tmp_path, model_path, mode, config=None):
    out = str(tmp_path / f"{mode}-{config or 'single'}")
    args = [model_path, out, mode]
    run([sys.executable, WORKER, *args] if config is None else launch_script(config, 2, WORKER, args), timeout=300)
    world = 1 if config is None else 2
    results = [json.loads(open(f"{out}.{r}.json").read()) for r in range(world)]
    tokens = {(r, p): (x, y) for res in results for r, p, x, y in res["tokens"]}
    assert all(res["chunkable"] for res in results)  # the tiled path ran, not the whole-logits fallback
    return tokens, results[0]["grad_norm"], torch.load(out + ".grads.pt")


def rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_chunked_equals_one_process_full_logits(tmp_path, tiny_model_path, tiny_tied_path, tied):
    path = tiny_tied_path if tied else tiny_model_path
    ref_tokens, ref_norm, ref_grads = _run(tmp_path, path, "full")
    tokens, norm, grads = _run(tmp_path, path, "chunked", "zero3.yaml")
    assert tokens.keys() == ref_tokens.keys() and len(tokens) > 30
    for key, (lp, ent) in tokens.items():
        assert lp == pytest.approx(ref_tokens[key][0], rel=TOL, abs=TOL) and ent == pytest.approx(
            ref_tokens[key][1], rel=TOL, abs=TOL), key
    assert norm == pytest.approx(ref_norm, rel=TOL)
    for name in ("lm_head", "embed"):
        assert rel(grads[name], ref_grads[name]) < TOL, name
