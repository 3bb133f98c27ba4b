"""recipes/reward_model.py as a user runs it: it separates held-out pairs, its export scores through PPO's
RewardModel, ZeRO-3 on two processes matches one, it trains on a margin column with centering, and the SFT -> reward
model -> PPO pipeline raises the reward model's score. (Its 2-step smoke run, configs and user mistakes:
test_all_recipes.py; where the reward is read: tests/rewards/test_reward_model.py.)"""

import json
import math

import pytest
import torch
from helpers import REPO, launch_cmd, load_weights, metrics, recipe_cmd, run

from verl_kit.data import load_split
from verl_kit.models import TINY_PREFS

RM_STEPS = 30


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    # 30 steps of 8 pairs, the shipped config otherwise (held-out accuracy 1.0 from step 10 on, loss 0.12 at step 10,
    # 0.02 at 30; one epoch is 250 steps).
    run(recipe_cmd("reward_model.py", ["--config", str(REPO / "recipes/configs/reward_model_tiny.yaml"),
                                       "--output_dir", str(out), "--max_steps", str(RM_STEPS)]), timeout=240)
    return out


@pytest.mark.slow
def test_reward_model_separates_held_out_pairs(trained, tiny_model_path):
    evals = [r for r in metrics(trained) if "eval/rewards/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == RM_STEPS
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=0.05)  # a fresh score head: no preference yet
    assert evals[-1]["eval/rewards/accuracy"] >= 0.9, evals
    assert evals[-1]["eval/loss"] < 0.1
    before, after = load_weights(tiny_model_path), load_weights(trained / "final")
    assert after["score.weight"].shape == (1, 128) and "lm_head.weight" not in after
    assert [k for k in after if k in before and torch.equal(before[k], after[k])] == []  # every parameter moved


@pytest.mark.slow
def test_export_scores_through_ppo_reward_model(trained):
    """PPO's --reward_model_name_or_path loader reads the export with its own tokenizer and chat template, renders
    prompt + reply as text and scores with HF's forward: it must rank the held-out pairs as the training run did."""
    from verl_kit.rewards import load_reward_model

    rm = load_reward_model(str(trained / "final"), lambda load: load().eval(), "cpu", 256, 16)
    assert rm.model.config.pad_token_id == rm.tokenizer.pad_token_id is not None
    rows = list(load_split(TINY_PREFS, "test"))
    prompts = [r["prompt"] for r in rows]
    chosen = rm.score(prompts, [r["chosen"][0]["content"] for r in rows])
    rejected = rm.score(prompts, [r["rejected"][0]["content"] for r in rows])
    assert (chosen > rejected).float().mean() >= 0.9


@pytest.mark.slow
def test_zero3_two_processes_match_single_process(tmp_path):
    common = ["--max_steps", "3", "--logging_steps", "1", "--dataset_test_split", "none", "--seed", "3"]
    single, z3 = tmp_path / "single", tmp_path / "z3"
    run(recipe_cmd("reward_model.py", ["--output_dir", str(single), "--per_device_train_batch_size", "8", *common]))
    run(launch_cmd("zero3.yaml", 2, "reward_model.py", ["--output_dir", str(z3), "--per_device_train_batch_size", "4",
                                                        *common]), timeout=300)
    head = metrics(z3)[0]
    assert head["world_size"] == 2 and head["params/local"] <= 0.55 * head["params/total"]
    by_step = lambda out, key: {r["step"]: r[key] for r in metrics(out) if key in r}
    for key, tol in (("loss", 1e-4), ("grad_norm", 1e-4), ("rewards/accuracy", 0)):
        a, b = by_step(z3, key), by_step(single, key)
        assert abs(a[1] - b[1]) <= tol * max(1.0, b[1]), (key, a, b)
    a, b = by_step(z3, "loss"), by_step(single, "loss")
    assert all(abs(a[s] - b[s]) < 1e-3 for s in (2, 3)), (a, b)
    exported = load_weights(z3 / "final")  # the ZeRO-3 shards gathered into one HF reward model
    assert sum(t.numel() for t in exported.values()) == head["params/total"]


@pytest.mark.slow
def test_margin_column_and_centering_train(tmp_path):
    """Preference rows with a `margin` column and --center_rewards_coefficient: the recipe trains on them. (A bad
    margin or a missing field as one line: test_all_recipes.py.)"""
    rows = [json.loads(line) for line in open(f"{TINY_PREFS}/test.jsonl")][:16]
    data = tmp_path / "margins.jsonl"
    data.write_text("".join(json.dumps({**r, "margin": 0.5}) + "\n" for r in rows))
    out = tmp_path / "o"
    run(recipe_cmd("reward_model.py", ["--output_dir", str(out), "--dataset_name", str(data), "--max_steps", "2",
                                       "--center_rewards_coefficient", "0.01", "--logging_steps", "1"]))
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_sft_then_reward_model_then_ppo(trained, tmp_path):
    """The pipeline: a briefly SFT-ed policy, the reward model this module trained on the preference pairs, served
    once (`python -m verl_kit.rewards.serve`, as several runs would share it; its key in VERL_KIT_REWARD_KEY), and PPO
    driven by that served reward model alone (--reward_model_url); the reward model's score of the policy's samples
    rises. (The served scores equal a local reward model's: tests/rewards/test_remote.py.)"""
    from helpers import reward_server

    sft, rm, ppo = tmp_path / "sft", trained, tmp_path / "ppo"
    none = ["--dataset_test_split", "none"]
    run(recipe_cmd("sft.py", ["--output_dir", str(sft), "--max_steps", "30", "--learning_rate", "1e-3", *none]))
    with reward_server(str(rm / "final"), tmp_path / "cache") as (url, key, _):
        run(recipe_cmd("ppo.py", ["--config", str(REPO / "recipes/configs/ppo_tiny.yaml"), "--output_dir", str(ppo),
                                  "--model_name_or_path", str(sft / "final"), "--reward_fn", "none",
                                  "--reward_model_url", url, "--max_steps", "12", "--logging_steps", "1", *none]),
            timeout=300, VERL_KIT_REWARD_KEY=key)
    reward = [r["reward/mean"] for r in metrics(ppo) if "reward/mean" in r]
    print("pipeline ppo reward", [round(x, 3) for x in reward])
    assert len(reward) == 12
    assert sum(reward[-4:]) / 4 > sum(reward[:2]) / 2 + 0.5, reward
