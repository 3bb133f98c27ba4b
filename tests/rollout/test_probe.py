"""The weight-sync probe in bf16 (verl_kit.rollout.probe; docs/gpu.md): its bf16 bound and "engine did not move"
detection, and a bf16 colocated vLLM engine followed through several updates. (bf16 DPO and GRPO runs end to end are
tests/recipes/test_all_recipes.py's 2-step runs; the device check's dry run: tests/test_bench.py.)"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import run_driver
from test_vllm import PROBE_TEXTS, encode, load_hf, train_step

from verl_kit.rollout.probe import Probe, default_probe_threshold, trainer_logprobs

BF16 = default_probe_threshold("bfloat16")


def test_probe_bf16_bound_and_stale_engine(tiny_model_path, tokenizer):
    """A bf16 copy of the policy scores like the fp32 trainer within the bf16 bound; after an update that reaches
    the copy the probe passes and both moved alike; after one that does not (a sync that did not take), the probe
    stops the run under the bf16 bound, which alone (5 nats) would let this stale engine through. The engine here is
    the bf16 HF copy (the vLLM one is the slow test below)."""
    trainer = load_hf(tiny_model_path)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    prompts = encode(tokenizer, PROBE_TEXTS)
    probe = Probe(prompts, BF16)

    def score(seqs):
        return trainer_logprobs(engine, seqs)

    first = probe.check(score, trainer, True)
    assert 0 < first["rollout/logprob_max_abs_diff"] < BF16  # bf16 rounding shows, within the bound
    train_step(trainer, tokenizer, lr=3e-2)  # an update that reaches the copy (moves the probe ~1.7, measured)
    engine.load_state_dict(trainer.state_dict())  # the sync: cast to bf16 on copy
    synced = probe.check(score, trainer, True)
    moved, followed = synced["rollout/probe_trainer_moved"], synced["rollout/probe_engine_moved"]
    assert 0.5 < moved < BF16 and 0.5 * moved < followed < 2 * moved, synced
    train_step(trainer, tokenizer, lr=3e-2)  # the same again, not synced
    with pytest.raises(RuntimeError, match="weight sync had no effect") as e:
        probe.check(score, trainer, True)
    assert "the engine's by 0" in str(e.value)


BF16_DRIVER = r'''
import copy, json, sys
sys.path[:0] = [{tests!r}, {tests!r} + "/.."]  # this folder's test modules, and tests/helpers.py
import torch
from test_vllm import encode, load_hf, train_step, PROBE_TEXTS
from verl_kit.models import load_tokenizer, resolve_model_path
from verl_kit.rollout import VLLMColocated
from verl_kit.rollout.probe import max_abs_diff, trainer_logprobs

if __name__ == "__main__":
    path = resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")  # docs/gpu.md: smollm2-135m too
    lr = float(sys.argv[2]) if len(sys.argv) > 2 else 3e-3
    tok = load_tokenizer(path)
    prompts = encode(tok, PROBE_TEXTS)
    model = load_hf(path)
    engine = VLLMColocated(path, tok, dtype="bfloat16", max_num_seqs=16, max_model_len=256, kv_cache_gib=1,
                           probe_prompts=prompts,  # the default bf16 bound, unless measuring (docs/gpu.md)
                           probe_threshold=float(sys.argv[3]) if len(sys.argv) > 3 else None)
    out = {{"threshold": engine.probe.threshold, "fp32_trainer": [], "bf16_trainer": [], "moved": [],
            "mean_diff": [], "mean_moved": []}}
    mean = lambda a, b: float(torch.cat([x - y for x, y in zip(a, b)]).abs().mean())  # noqa: E731
    for version in range(4):  # the first load, then three updates, each synced and probed as a recipe does
        if version:
            train_step(model, tok, lr=lr)
        last = engine.probe.last
        m = engine.load_weights(model, version=version)
        out["fp32_trainer"].append(m["rollout/logprob_max_abs_diff"])
        out["moved"].append([m["rollout/probe_trainer_moved"], m["rollout/probe_engine_moved"]])
        e, t = engine.probe.last
        out["mean_diff"].append(mean(e, t))
        if last is not None:
            out["mean_moved"].append([mean(t, last[1]), mean(e, last[0])])
        bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the trainer under ZeRO-3 bf16: bf16 parameters
        out["bf16_trainer"].append(max_abs_diff(engine.score(prompts), trainer_logprobs(bf16, prompts)))
    train_step(model, tok, lr=10 * lr)  # an update the engine never gets
    try:
        out["unsynced"] = engine.probe.check(engine.score, model, True)
        out["stale_error"] = ""
    except RuntimeError as e:
        out["stale_error"] = str(e)
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.vllm
def test_bf16_engine_probe_over_updates():
    """A bf16 colocated engine follows an fp32 trainer (one process) through three synced updates within the bf16
    bound, also against a bf16 copy of the trainer (ZeRO-3 bf16), and the probe stops a sync that did not take."""
    out = run_driver(BF16_DRIVER.format(tests=str(Path(__file__).parent)), timeout=420, VLLM_HOST_IP="127.0.0.1")
    print(f"bf16 engine: {out}")
    assert out["threshold"] == BF16
    for diffs in (out["fp32_trainer"], out["bf16_trainer"]):
        assert max(diffs) < BF16 and min(diffs) > 0, diffs  # bf16 rounding shows, within the bound
    for trainer_moved, engine_moved in out["moved"][1:]:
        assert trainer_moved > 0.05 and engine_moved > 0.5 * trainer_moved  # the engine followed each update
    assert "weight sync had no effect" in out["stale_error"], out["stale_error"]
