"""train.EmaTeacher (self-distillation's `--teacher_model_kind ema`) by hand: teacher <- 0.75 teacher + 0.25 student
after every 2nd optimizer step and its state round-trips, in one process and under ZeRO-3 x2, where each process
averages its own shards, no gather: the by-hand check reads the gathered whole tensors
(tests/train/ema_teacher_worker.py). (That ZeRO-3 trains the student as one process does:
tests/train/test_distributed.py.)"""

import sys

import pytest
import torch
from helpers import REPO, launch_script, run

WORKER = str(REPO / "tests" / "train" / "ema_teacher_worker.py")


def _record(tmp_path, model_path, config=None) -> dict:
    out = str(tmp_path / f"ema-{config or 'single'}.pt")
    run([sys.executable, WORKER, model_path, out] if config is None else
        launch_script(config, 2, WORKER, [model_path, out]), timeout=300)
    return torch.load(out)


def _check_by_hand(r: dict) -> None:
    assert r["steps"] == 3
    for name, initial in r["initial"].items():
        assert torch.equal(r["teacher1"][name], initial), name  # step 1: no sync
        want = 0.75 * initial + 0.25 * r["student2"][name]
        torch.testing.assert_close(r["teacher2"][name], want, rtol=1e-6, atol=1e-7)
        assert torch.equal(r["teacher3"][name], r["teacher2"][name]), name  # step 3: no sync
        assert torch.equal(r["reloaded"][name], r["teacher3"][name]), name
    moved = [n for n in r["initial"] if not torch.equal(r["student2"][n], r["initial"][n])]
    assert len(moved) == len(r["initial"]), "every parameter trained, so every one is averaged"


@pytest.mark.parametrize("config", [None, pytest.param("zero3.yaml", marks=pytest.mark.slow)])
def test_ema_teacher_by_hand(tmp_path, tiny_tied_path, config):
    """On the tied tiny model (one weight for embedding and output layer: averaged once)."""
    _check_by_hand(_record(tmp_path, tiny_tied_path, config))
