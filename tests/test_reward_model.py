"""Reward model: the Bradley-Terry loss against values worked by hand, rewards read at each sequence's last real
token (packed == padded == HF's own forward, also with pad == EOS), and recipes/reward_model.py as a user runs it: it
separates held-out pairs, its export scores through PPO's RewardModel, and ZeRO-3 on two processes matches one.
(Its 2-step smoke run, configs and user mistakes: test_recipes.py.)"""

import json
import math

import pytest
import torch
from helpers import REPO, launch_cmd, load_weights, metrics, recipe_cmd, run

from verl_kit.algos import bradley_terry_loss
from verl_kit.data import TokenBatch, layout, load_split, preference_examples
from verl_kit.errors import UserError
from verl_kit.models import TINY_PREFS
from verl_kit.rewards import last_token_index, load_reward_classifier, margins, sequence_rewards
from verl_kit.train import completion_sequences

# ---- the loss, by hand --------------------------------------------------------------------------------------------


def test_bradley_terry_hand_values():
    """-log sigma(d) = log(1 + e^-d), d = r_w - r_l - m:
    (2, 0):  d = 2,  log(1 + e^-2) = log(1.135335) = 0.126928
    (0, 0):  d = 0,  log 2 = 0.693147
    (0, 1):  d = -1, log(1 + e^1) = log(3.718282) = 1.313262
    with margin 1 on (2, 0): d = 1, log(1 + e^-1) = log(1.367879) = 0.313262"""
    chosen, rejected = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), torch.tensor([0.126928, 0.693147, 1.313262]),
                               atol=1e-6, rtol=0)
    loss = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([0.313262, 0.693147, 1.313262]), atol=1e-6, rtol=0)


def test_centering_term_hand_values():
    """center 0.5: (1, -1) adds 0.5 * 0^2 = 0 to log(1 + e^-2) = 0.126928; (1, 1) adds 0.5 * 2^2 = 2 to log 2:
    2.693147. The gradient of the second in r_w: -sigma(-0) + 0.5 * 2 * (1 + 1) = -0.5 + 2 = 1.5."""
    chosen = torch.tensor([1.0, 1.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, torch.tensor([-1.0, 1.0]), center_coefficient=0.5)
    torch.testing.assert_close(loss.detach(), torch.tensor([0.126928, 2.693147]), atol=1e-6, rtol=0)
    loss.sum().backward()
    # first: -sigma(-2) + 0.5 * 2 * 0 = -0.119203
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.119203, 1.5]), atol=1e-6, rtol=0)


# ---- where the reward is read --------------------------------------------------------------------------------------


def test_last_token_index_by_hand():
    """Row 0 packs sequence 0 = [5, 6, 1] and sequence 1 = [7, 1]; row 1 holds sequence 2 = [8, 9] then padding.
    Flat positions: row 0 is 0..4, row 1 is 5..9. With pad 0, the ends are positions 2, 4 and 6. With pad == EOS
    (1), HF's rule skips the trailing EOS: positions 1, 3 and 6."""
    ids = torch.tensor([[5, 6, 1, 7, 1], [8, 9, 1, 1, 1]])
    seq = torch.tensor([[0, 0, 0, 1, 1], [2, 2, -1, -1, -1]])
    batch = TokenBatch(ids, torch.zeros_like(ids), seq, seq >= 0, None, 3)
    assert last_token_index(batch, pad_id=0).tolist() == [2, 4, 6]
    assert last_token_index(batch, pad_id=1).tolist() == [1, 3, 6]
    values = torch.arange(10.0).view(2, 5)
    assert sequence_rewards(values, batch, pad_id=1).tolist() == [1.0, 3.0, 6.0]


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_packed_rewards_equal_padded_and_hf_forward(tiny_model_path, tokenizer, pad_is_eos):
    """Rewards and Bradley-Terry gradients of packed rows equal those of padded rows, and the rewards equal HF's own
    forward (the pooled score PPO's RewardModel reads), with a real pad token and with pad == EOS (the fallback for
    tokenizers without one)."""
    pad = tokenizer.eos_token_id if pad_is_eos else tokenizer.pad_token_id
    torch.manual_seed(0)
    rm = load_reward_classifier(tiny_model_path, pad, attn_implementation="sdpa")
    with torch.no_grad():  # away from init
        for p in rm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    exs = preference_examples(load_split(TINY_PREFS, "test[:6]"), tokenizer, 64, 128, "tiny_prefs")
    items = [completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    seqs, masks = [s for it in items for s in it[0]], [m for it in items for m in it[1]]

    def rewards_and_grads(packing):
        rm.zero_grad()
        batch = layout(seqs, masks, pad, packing=packing, packing_length=96)
        r = sequence_rewards(rm(batch.input_ids, batch.attention_mask, batch.position_ids), batch, pad)
        bradley_terry_loss(r.view(-1, 2)[:, 0], r.view(-1, 2)[:, 1]).mean().backward()
        return batch, r.detach(), {n: p.grad.clone() for n, p in rm.named_parameters()}

    padded, r_pad, g_pad = rewards_and_grads(False)
    packed, r_pack, g_pack = rewards_and_grads(True)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # really packed
    torch.testing.assert_close(r_pack, r_pad, atol=1e-5, rtol=0)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        hf = rm.classifier(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, 0]
    torch.testing.assert_close(r_pad, hf, atol=1e-5, rtol=0)
    assert r_pad.std() > 1e-3  # rewards that differ, so the comparison means something


def test_margin_column(tmp_path):
    import datasets

    assert margins(datasets.Dataset.from_list([{"chosen": "a"}]), "d") is None
    ok = datasets.Dataset.from_list([{"margin": 1}, {"margin": 0.5}])
    assert margins(ok, "d").tolist() == [1.0, 0.5]
    bad = datasets.Dataset.from_list([{"margin": 1.0}, {"margin": None}])
    with pytest.raises(UserError, match=r"^d row 2: field 'margin' must be a finite number, got None$"):
        margins(bad, "d")


# ---- the recipe ---------------------------------------------------------------------------------------------------


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
    margin or a missing field as one line: test_recipes.py.)"""
    rows = [json.loads(line) for line in open(f"{TINY_PREFS}/test.jsonl")][:16]
    data = tmp_path / "margins.jsonl"
    data.write_text("".join(json.dumps({**r, "margin": 0.5}) + "\n" for r in rows))
    out = tmp_path / "o"
    run(recipe_cmd("reward_model.py", ["--output_dir", str(out), "--dataset_name", str(data), "--max_steps", "2",
                                       "--center_rewards_coefficient", "0.01", "--logging_steps", "1"]))
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_sft_then_reward_model_then_ppo(trained, tmp_path):
    """The pipeline: a briefly SFT-ed policy, the reward model this module trained on the preference pairs, and PPO
    driven by that reward model alone; the reward model's score of the policy's samples rises."""
    sft, rm, ppo = tmp_path / "sft", trained, tmp_path / "ppo"
    none = ["--dataset_test_split", "none"]
    run(recipe_cmd("sft.py", ["--output_dir", str(sft), "--max_steps", "30", "--learning_rate", "1e-3", *none]))
    run(recipe_cmd("ppo.py", ["--config", str(REPO / "recipes/configs/ppo_tiny.yaml"), "--output_dir", str(ppo),
                              "--model_name_or_path", str(sft / "final"), "--reward_fn", "none",
                              "--reward_model_name_or_path", str(rm / "final"), "--max_steps", "12",
                              "--logging_steps", "1", *none]), timeout=300)
    reward = [r["reward/mean"] for r in metrics(ppo) if "reward/mean" in r]
    print("pipeline ppo reward", [round(x, 3) for x in reward])
    assert len(reward) == 12
    assert sum(reward[-4:]) / 4 > sum(reward[:2]) / 2 + 0.5, reward
