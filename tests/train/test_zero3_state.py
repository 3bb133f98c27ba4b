"""ZeRO-3 and FSDP2 partition what they should: on 2 processes, each rank's parameters and gradients take at most
~half of the full model's bytes, measured where model state peaks (after the last backward of a step, before its
update) by the bench's own state worker (bench/harness.py state-worker, the figures behind
`zero3_state_bytes_vs_ddp` and `fsdp2_state_bytes_vs_ddp`). Byte counts are deterministic, so a full (unpartitioned)
copy kept somewhere fails here. The tiny model's matrices are all below DeepSpeed's default persistence threshold
(1e5 elements: such parameters stay whole on every rank by design), so the ZeRO-3 worker runs with threshold 0 and
every parameter must be partitioned."""

import json

import pytest
from helpers import REPO, launch_script, run

WORKER = str(REPO / "bench" / "harness.py")


@pytest.mark.slow
def test_zero3_partitions_params_and_grads(tmp_path, tiny_model_path):
    out = tmp_path / "state.json"
    run(launch_script("zero3.yaml", 2, WORKER, ["state-worker", "--model", tiny_model_path, "--out", str(out),
                                                "--persistence_threshold", "0"]), timeout=600)
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2 and all(r["zero_stage"] == 3 for r in ranks)
    for r in ranks:
        full = r["full_param_bytes"]
        assert r["persistent_params"] == 0, r
        assert 0 < r["param_bytes"] <= 0.55 * full, r
        assert 0 < r["grad_bytes"] <= 0.55 * full, r
        assert r["optimizer_bytes"] > 0, r  # measured after a first step
        assert r["gathered_param_bytes"] == 0, r  # and between passes: nothing gathered for compute is left


@pytest.mark.slow
def test_fsdp2_shards_params_grads_and_optimizer_state(tmp_path, tiny_model_path):
    """FSDP2 x2 (fully_shard per layer and root, no persistence threshold): every parameter, gradient and AdamW moment
    is a DTensor shard, so each rank holds about half of each (DDP: all of it)."""
    out = tmp_path / "state.json"
    run(launch_script("fsdp2.yaml", 2, WORKER, ["state-worker", "--model", tiny_model_path, "--out", str(out)]),
        timeout=600)
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2 and all(r["sharding"] == "fsdp2" for r in ranks)
    for r in ranks:
        full = r["full_param_bytes"]
        assert 0.45 * full <= r["param_bytes"] <= 0.55 * full, r
        assert 0.45 * full <= r["grad_bytes"] <= 0.55 * full, r
        assert 0.9 * full <= r["optimizer_bytes"] <= 1.1 * full, r  # two moments, each half
        assert r["gathered_param_bytes"] == 0, r
