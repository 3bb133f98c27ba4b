"""GRPO on the packaged real model (SmolLM2-135M-Instruct: tied embeddings, GQA, pad == EOS) with vLLM rollouts, at a
high learning rate so every update moves the policy: the probe (engine log-probs against the trainer's, after every
sync) stays within the fp32 bound and the engine follows each update, with the colocated engine. Before the
tied-embedding fix this model gave 0.07-0.13 after the first update. (The server's transport of a tied model:
test_weight_sync.test_server_sync_matches_trainer_tied; a LoRA adapter merged into the synced weights of a tied model:
test_lora.test_grpo_lora_vllm_sync_on_tied_model.)"""

import pytest
from helpers import metrics, recipe_cmd, run

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.vllm]

ARGS = ["--model_name_or_path", "smollm2-135m", "--max_steps", "2", "--prompts_per_step", "4",
        "--num_generations", "2", "--max_completion_length", "8", "--learning_rate", "1e-4", "--beta", "0",
        "--lr_scheduler_type", "constant", "--logging_steps", "1", "--dataset_test_split", "none",
        "--gradient_checkpointing", "false", "--max_length", "256", "--max_prompt_length", "128",
        "--vllm_probe_size", "2"]


def test_grpo_real_model_probe_after_every_sync(tmp_path, smollm2_path):
    reward = tmp_path / "reward.py"  # a reward that differs within every group, so every update has a gradient
    reward.write_text("def longer(prompts, completions):\n    return [len(c) / 40 for c in completions]\n")
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--rollout", "vllm", "--output_dir", str(out), "--reward_fn", f"{reward}:longer",
                               *ARGS]), timeout=480, VLLM_HOST_IP="127.0.0.1")
    rows = [r for r in metrics(out) if "reward/mean" in r]
    print([(r["rollout/logprob_max_abs_diff"], r["rollout/probe_trainer_moved"]) for r in rows])
    assert [r["step"] for r in rows] == [1, 2]  # two updates, two syncs, each probed
    for r in rows:
        assert r["rollout/logprob_max_abs_diff"] < 1e-3, r  # the fp32 bound (default for an fp32 engine)
        assert r["rollout/probe_trainer_moved"] > 1e-3, r  # each update moved the policy...
        assert abs(r["rollout/probe_engine_moved"] - r["rollout/probe_trainer_moved"]) < 1e-3, r  # ...and the engine
