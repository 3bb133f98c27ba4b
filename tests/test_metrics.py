"""MetricsLogger.end_step, the one end-of-step rule of every recipe: which steps evaluate (every --eval_steps and the
last, collective, so every process must call it) and which are logged (every --logging_steps, the run's first step,
the last, an evaluation step), the held-out numbers in the step's own row."""

import json

from verl_kit.metrics import MetricsLogger


class _Main:
    """What MetricsLogger needs of an accelerator: the main process, no trackers."""
    is_main_process, log_with = True, None


def test_end_step_evaluates_and_logs_on_one_schedule(tmp_path):
    """A run resumed at step 2 of 7, --logging_steps 3, --eval_steps 2: it evaluates at 4, 6 and 7 (the last) and logs
    3 (its first step), 4 (eval), 6 (both), 7 (last); step 5 is neither. Without a held-out split (evaluate None)
    nothing evaluates and only 3 and 6 are logged (the first, a logging step) plus the last."""
    log = MetricsLogger(_Main(), str(tmp_path), total_steps=7, start_step=2)
    evaluated = []

    def evaluate():
        evaluated.append(True)
        return {"eval/score": float(len(evaluated))}

    logged = [step for step in range(3, 8) if log.end_step(step, {"loss": 1.0 / step}, 3, 2, evaluate, "loss")]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 4, 6, 7] == [r["step"] for r in rows]
    assert [r.get("eval/score") for r in rows] == [None, 1.0, 2.0, 3.0] and len(evaluated) == 3
    assert all(r["loss"] == 1.0 / r["step"] for r in rows)

    (tmp_path / "plain").mkdir()
    plain = MetricsLogger(_Main(), str(tmp_path / "plain"), total_steps=7, start_step=2)
    assert [s for s in range(3, 8) if plain.end_step(s, {"loss": 0.0}, 3, 2, progress="loss")] == [3, 6, 7]
