"""verl_kit.rewards.reward_model: rewards read at each sequence's last real token (packed == padded == HF's own
forward, also with pad == EOS), and the margin column. (The Bradley-Terry loss by hand: tests/algos/test_preference.py;
recipes/reward_model.py as a user runs it: tests/recipes/test_reward_model_runs.py.)"""

import pytest
import torch

from verl_kit.algos import bradley_terry_loss
from verl_kit.data import TokenBatch, layout, load_split, preference_examples
from verl_kit.errors import UserError
from verl_kit.models import TINY_PREFS
from verl_kit.rewards import last_token_index, load_reward_classifier, margins, sequence_rewards
from verl_kit.train import completion_sequences


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
        r = sequence_rewards(rm(**batch.inputs()), batch, pad)
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
