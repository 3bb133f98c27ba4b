"""Nothing non-finite reaches the weights (issue 39, item 2): a step whose loss or gradient norm is NaN or inf is
skipped on every process (weights and optimizer state untouched, gradients zeroed, the LR schedule still advancing),
counted in Trainable.nonfinite_skips, and MAX_NONFINITE_SKIPS in a row stop the run with one line. In one process
(plain AdamW), under ZeRO-3 on two processes with the NaN on one of them only, and through recipes/sft.py with a
learning rate that overflows the weights' next forward."""

import json
import math

import pytest
import torch
from helpers import launch_script, load_weights, metrics, recipe_cmd, run

from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.train.trainable import MAX_NONFINITE_SKIPS, Trainable


def _linear():
    from verl_kit.train import Accelerator

    torch.manual_seed(0)
    return Trainable(Accelerator(cpu=True), torch.nn.Linear(4, 1), TrainConfig(), learning_rate=0.1, total_steps=100)


def _state(t: Trainable) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()] + \
        [v.clone() for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _step(t: Trainable, loss_of) -> float:
    for _ in t.accumulate([0]):
        t.backward(loss_of(t.model(torch.ones(2, 4)).sum()))
    return t.step()


def test_a_nonfinite_step_is_skipped_and_counted():
    """A finite step moves the weights; a NaN loss, then an inf loss whose gradients are finite (a constant added:
    AdamW would still have moved the weights with its moments), leave weights and optimizer state bit-identical
    and zero the gradients while the LR schedule advances; the next finite step applies and resets the run of
    skips. MAX_NONFINITE_SKIPS NaN steps in a row then stop the run with one line."""
    t = _linear()
    assert math.isfinite(_step(t, lambda y: y ** 2)) and t.nonfinite_skips == 0
    for bad in (lambda y: y * math.nan, lambda y: y + math.inf):
        before, lr = _state(t), t.learning_rate
        assert not math.isfinite(_step(t, bad))
        assert all(torch.equal(a, b) for a, b in zip(before, _state(t)))
        assert all(p.grad is None or not p.grad.any() for p in t.model.parameters())
        assert t.learning_rate < lr  # linear decay: the schedule still advanced
    assert (t.nonfinite_skips, t.consecutive_skips) == (2, 2)
    before = _state(t)
    _step(t, lambda y: y ** 2)
    assert not torch.equal(before[0], _state(t)[0]) and (t.nonfinite_skips, t.consecutive_skips) == (2, 0)
    for _ in range(MAX_NONFINITE_SKIPS - 1):
        _step(t, lambda y: y * math.nan)
    with pytest.raises(UserError, match=rf"^{MAX_NONFINITE_SKIPS} optimizer steps in a row had a non-finite loss or "
                                        r"gradient norm \(the last: nan\) and were skipped: the run stops") as e:
        _step(t, lambda y: y * math.nan)
    assert "\n" not in str(e.value) and all(bool(torch.isfinite(p).all()) for p in t.model.parameters())


def _check_worker(steps: list[dict]) -> None:
    assert [s["changed"] for s in steps] == [True, False, False, True]
    assert [s["skips"] for s in steps] == [0, 1, 2, 2]
    assert all(s["finite"] for s in steps) and math.isfinite(steps[0]["grad_norm"])
    assert not math.isfinite(steps[1]["grad_norm"]) and not math.isfinite(steps[2]["grad_norm"])
    assert steps[0]["lr"] > steps[1]["lr"] > steps[2]["lr"] > steps[3]["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3.yaml", "fsdp2.yaml"])
def test_sharded_skips_on_every_process(tmp_path, tiny_model_path, config):
    """ZeRO-3 on two processes (DeepSpeed's engine takes the decision on the global norm it reduces), or FSDP2 (the
    norm of the DTensor gradients, the flag reduced): step 2's NaN on process 1 alone skips the step on both, step
    3's inf loss with finite gradients too; steps 1 and 4 apply."""
    out = tmp_path / "sharded.json"
    run(launch_script(config, 2, "tests/train/nonfinite_worker.py", [tiny_model_path, str(out)]), timeout=400)
    got = json.loads(out.read_text())
    assert got["world"] == 2
    _check_worker(got["steps"])


@pytest.mark.slow
def test_sft_whose_weights_overflow_stops_in_one_line(tmp_path):
    """recipes/sft.py at learning rate 1e30: step 1 applies (weights ~1e30, still finite), the next forward overflows
    and every later step is NaN, so steps 2 to 11 are skipped (warned each) and the run stops after the tenth, exit 2
    with one line; every checkpoint holds finite weights."""
    out = tmp_path / "sft"
    p = run(recipe_cmd("sft.py", ["--config", "recipes/configs/sft_tiny.yaml", "--learning_rate", "1e30",
                                  "--max_steps", "20", "--save_steps", "5", "--logging_steps", "1",
                                  "--dataset_test_split", "none", "--output_dir", str(out)]), check=False,
            timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: {MAX_NONFINITE_SKIPS} optimizer steps in a row had a "
                                                        "non-finite loss or gradient norm")
    assert p.stderr.count("optimizer step skipped") == MAX_NONFINITE_SKIPS - 1
    rows = [r for r in metrics(out) if "grad_norm" in r]
    assert [r["step"] for r in rows] == list(range(1, MAX_NONFINITE_SKIPS + 1))
    assert math.isfinite(rows[0]["grad_norm"]) and not any(math.isfinite(r["grad_norm"]) for r in rows[1:])
    saved = sorted(out.glob("checkpoint-*"))
    assert saved
    for d in saved:
        assert all(bool(torch.isfinite(w).all()) for w in load_weights(d).values()), d
