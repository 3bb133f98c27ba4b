"""The one optimizer-step path (engine.Trainable) on every backend: one process, DDP x2 and ZeRO-3 x2 (real
DeepSpeed, gloo over loopback) give the same losses and grad norms on the same global batches, clipping included
(max_grad_norm 0.5 is below the first step's norm), and the weights change in step() only, never in backward()."""

import json
import sys

import pytest
from helpers import REPO, launch_script, run

pytestmark = pytest.mark.slow

WORKER = str(REPO / "tests" / "train" / "engine_worker.py")


def _run(tmp_path, tiny_model_path, config):
    out = tmp_path / f"{config or 'single'}.json"
    args = [tiny_model_path, str(out)]
    run([sys.executable, WORKER, *args] if config is None else launch_script(config, 2, WORKER, args), timeout=300)
    return json.loads(out.read_text())


def test_step_path_same_on_every_backend(tmp_path, tiny_model_path):
    results = {c: _run(tmp_path, tiny_model_path, c) for c in (None, "ddp.yaml", "zero3.yaml")}
    single = results[None]["steps"]
    assert single[0]["grad_norm"] > 0.5  # clipping is exercised
    assert [r["lr"] for r in single] == pytest.approx([1e-2 * 2 / 3, 1e-2 / 3, 0.0])  # linear schedule, stepped once
    for config, res in results.items():
        assert res["world"] == (1 if config is None else 2)
        assert not res["updated_in_backward"], config
        assert all(r["changed"] for r in res["steps"]), config
        for a, b in zip(res["steps"], single):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), (config, res["steps"], single)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (config, res["steps"], single)
            assert a["lr"] == pytest.approx(b["lr"])
