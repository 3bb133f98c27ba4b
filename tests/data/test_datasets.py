"""verl_kit.data.datasets: every accepted preference format, and every bad input, with the one-line error it must
give; KTO's unpaired data (standard and conversational, paired data unpaired behind a flag, bad labels), the
mismatched partners of its KL sequences, and those sequences packed == padded."""

import json

import pytest
import torch
from helpers import write_jsonl

from verl_kit.algos import kl_reference_point, kto_loss
from verl_kit.data import (
    layout,
    load_split,
    mismatched_partners,
    preference_examples,
    unpaired_examples,
)
from verl_kit.errors import UserError
from verl_kit.models import TINY_PREFS, load_causal_lm
from verl_kit.train import sequence_logprobs

CONV = {"prompt": [{"role": "user", "content": "Tell me about the sea."}],
        "chosen": [{"role": "assistant", "content": "The sea is lovely."}],
        "rejected": [{"role": "assistant", "content": "The sea is dull."}]}


def examples(tmp_path, rows, tokenizer, max_prompt_length=64, max_length=128, name="d.jsonl"):
    path = write_jsonl(tmp_path / name, rows)
    return preference_examples(load_split(path, "train"), tokenizer, max_prompt_length, max_length, path)


def decode(tokenizer, ids):
    return tokenizer.decode(ids)


def test_conversational_explicit_prompt(tmp_path, tokenizer):
    (ex,) = examples(tmp_path, [CONV], tokenizer)
    assert decode(tokenizer, ex.prompt_ids) == "<|user|>Tell me about the sea.<|end|><|assistant|>"
    assert decode(tokenizer, ex.chosen_ids) == "The sea is lovely.<|end|>"
    assert decode(tokenizer, ex.rejected_ids) == "The sea is dull.<|end|>"


def test_conversational_implicit_prompt_matches_explicit(tmp_path, tokenizer):
    implicit = {"chosen": CONV["prompt"] + CONV["chosen"], "rejected": CONV["prompt"] + CONV["rejected"]}
    (a,) = examples(tmp_path, [CONV], tokenizer, name="a.jsonl")
    (b,) = examples(tmp_path, [implicit], tokenizer, name="b.jsonl")
    assert (a.prompt_ids, a.chosen_ids, a.rejected_ids) == (b.prompt_ids, b.chosen_ids, b.rejected_ids)


def test_standard_explicit_and_implicit_prompt(tmp_path, tokenizer):
    explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    (a,) = examples(tmp_path, [explicit], tokenizer, name="a.jsonl")
    (b,) = examples(tmp_path, [implicit], tokenizer, name="b.jsonl")
    assert decode(tokenizer, a.prompt_ids) == "The sky is"
    assert decode(tokenizer, a.chosen_ids) == " blue.<|end|>"  # eos appended to standard completions
    assert decode(tokenizer, b.prompt_ids + b.chosen_ids) == "The sky is blue.<|end|>"


def test_json_parquet_and_split_slicing(tmp_path, tokenizer):
    import datasets

    rows = [dict(CONV) for _ in range(10)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert len(load_split(str(tmp_path / "d.json"), "train")) == 10
    assert len(load_split(str(tmp_path / "d.parquet"), "train[:3]")) == 3
    # a directory of split files: train/test
    d = tmp_path / "ds"
    d.mkdir()
    write_jsonl(d / "train.jsonl", rows)
    write_jsonl(d / "test.jsonl", rows[:4])
    assert len(load_split(str(d), "test")) == 4
    assert len(load_split(str(d), "train[50%:]")) == 5


def test_embedded_dataset_loads(tokenizer):
    from verl_kit.models import TINY_PREFS

    train = preference_examples(load_split(TINY_PREFS, "train"), tokenizer, 64, 128, "tiny")
    test = preference_examples(load_split(TINY_PREFS, "test"), tokenizer, 64, 128, "tiny")
    assert len(train) == 2000 and len(test) == 200


def test_truncation_keeps_prompt_end_and_a_nonempty_completion(tmp_path, tokenizer):
    row = {"prompt": "word " * 50, "chosen": "good " * 50, "rejected": "bad " * 50}
    (ex,) = examples(tmp_path, [row], tokenizer, max_prompt_length=10, max_length=16)
    assert len(ex.prompt_ids) == 10
    assert len(ex.prompt_ids) + len(ex.chosen_ids) == 16 and len(ex.rejected_ids) == 6


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "rejected": "r"}, "row 2: missing field 'chosen'"),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, "row 2: field 'chosen' must be a string"),
    ({"prompt": "p", "chosen": "  ", "rejected": "r"}, "row 2: field 'chosen' is empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "x"}]}, "row 2: field 'chosen' is empty"),
    ({"prompt": "p", "chosen": "c", "rejected": None}, "row 2: missing field 'rejected'"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer, row, expected):
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    with pytest.raises(UserError, match=expected) as e:
        examples(tmp_path, [good, row], tokenizer)
    assert "d.jsonl" in str(e.value) and "\n" not in str(e.value)


def test_row_too_long_for_max_length(tmp_path, tokenizer):
    row = {"prompt": "word " * 40, "chosen": "c", "rejected": "r"}
    with pytest.raises(UserError, match=r"row 1: prompt is \d+ tokens, leaving no room .* --max_length 16"):
        examples(tmp_path, [row], tokenizer, max_prompt_length=None, max_length=16)


def test_empty_dataset_and_missing_split(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty.jsonl"):
        load_split(str(tmp_path / "empty.jsonl"), "train")
    path = write_jsonl(tmp_path / "d.jsonl", [CONV])
    with pytest.raises(UserError, match="only the split 'train'"):
        load_split(path, "validation")
    assert load_split(path, "test", required=False) is None
    with pytest.raises(UserError, match="is empty"):
        load_split(path, "train[1:]")
    with pytest.raises(UserError, match="no such file"):
        load_split(str(tmp_path / "missing.jsonl"), "train")


def test_conversational_without_chat_template(tmp_path, tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(UserError, match="row 1: conversational data needs a chat template"):
        examples(tmp_path, [CONV], tok)


def test_malformed_json_names_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "chosen": \n')
    with pytest.raises(UserError, match="bad.jsonl"):
        load_split(str(tmp_path / "bad.jsonl"), "train")


# ---- KTO's unpaired data --------------------------------------------------------------------------------------------


def test_unpaired_standard_and_conversational(tmp_path, tokenizer):
    std = write_jsonl(tmp_path / "std.jsonl", [
        {"prompt": "Tell me about the sea.", "completion": "It is calm.", "label": True},
        {"prompt": "Describe the park.", "completion": "It is dull.", "label": False}])
    exs = unpaired_examples(load_split(std, "train"), tokenizer, 256, 512, std)
    assert [e.label for e in exs] == [True, False]
    assert tokenizer.decode(exs[0].completion_ids) == "It is calm.<|end|>"  # eos appended to standard completions
    conv = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "Describe the park."}],
                                             "completion": [{"role": "assistant", "content": "It is dull."}],
                                             "label": False}])
    (ex,) = unpaired_examples(load_split(conv, "train"), tokenizer, 256, 512, conv)
    assert tokenizer.decode(ex.prompt_ids).endswith("<|user|>Describe the park.<|end|><|assistant|>")
    assert tokenizer.decode(ex.completion_ids) == "It is dull.<|end|>" and ex.label is False


def test_paired_data_unpaired_behind_flag(tokenizer):
    """Row i of the embedded paired data -> examples 2i (chosen, desirable) and 2i+1 (rejected, undesirable)."""
    ds = load_split(TINY_PREFS, "test[:3]")
    exs = unpaired_examples(ds, tokenizer, 256, 512, "prefs")
    assert [e.label for e in exs] == [True, False] * 3
    assert exs[0].prompt_ids == exs[1].prompt_ids
    assert tokenizer.decode(exs[2].completion_ids) == ds[1]["chosen"][0]["content"] + "<|end|>"
    assert tokenizer.decode(exs[3].completion_ids) == ds[1]["rejected"][0]["content"] + "<|end|>"
    with pytest.raises(UserError, match="prefs: a paired preference dataset .* --unpair_preference_dataset"):
        unpaired_examples(ds, tokenizer, 256, 512, "prefs", unpair=False)


@pytest.mark.parametrize("label, expected", [
    (None, "row 2: missing field 'label'"),
    ("yes", "row 2: field 'label' must be true or false, got str 'yes'"),
    (1, "row 2: field 'label' must be true or false, got int 1"),
])
def test_bad_label_rows(tmp_path, tokenizer, label, expected):
    row = {"prompt": "Describe the park.", "completion": "It is dull."}
    path = write_jsonl(tmp_path / "bad.jsonl", [{**row, "label": True}, {**row, **({"label": label} if label else {})}])
    with pytest.raises(UserError) as e:
        unpaired_examples(load_split(path, "train"), tokenizer, 256, 512, path)
    assert str(e.value) == f"{path} {expected}" and "\n" not in str(e.value)


def test_mismatched_partners():
    """Fixed per example (so reference log-probs can be precomputed), never itself, never the same prompt when
    another exists, every completion used once when prompts are distinct, and deterministic in the seed."""
    prompts = [[i] for i in range(50)]
    partner = mismatched_partners(prompts, seed=3)
    assert all(j != i for i, j in enumerate(partner)) and sorted(partner) == list(range(50))
    assert partner == mismatched_partners(prompts, seed=3) != mismatched_partners(prompts, seed=4)
    siblings = [[i // 2] for i in range(40)]  # paired data unpaired: examples 2k and 2k+1 share a prompt
    assert all(siblings[j] != siblings[i] for i, j in enumerate(mismatched_partners(siblings, seed=0)))


# ---- its target and KL sequences, packed == padded ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_path):
    torch.manual_seed(0)
    m = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    with torch.no_grad():  # move away from init so logits are not nearly uniform
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def test_packed_kto_target_and_kl_equal_padded(model):
    """Target sequences (x_i, y_i) and KL sequences (x_i, y_j(i)), packed vs padded: the KL log-ratio sum, the loss
    and every gradient agree in fp32 (atol 1e-5)."""
    g = torch.Generator().manual_seed(1)
    rand = lambda lo, hi: torch.randint(5, 600, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
    prompts, comps = [rand(2, 12) for _ in range(7)], [rand(1, 15) for _ in range(7)]
    partner = mismatched_partners(prompts, seed=0)
    labels = torch.tensor([True, False, False, True, True, False, True])
    ref, ref_kl = torch.randn(7) - 30, torch.randn(7) - 30

    def seqs(kl):
        out = [prompts[i] + comps[partner[i] if kl else i] for i in range(7)]
        return out, [[False] * len(prompts[i]) + [True] * (len(s) - len(prompts[i])) for i, s in enumerate(out)]

    def loss_and_grads(packing):
        model.zero_grad()
        with torch.no_grad():
            kl_batch = layout(*seqs(True), pad_id=0, packing=packing, packing_length=40)
            kl_sum = (sequence_logprobs(model, kl_batch) - ref_kl).sum()
        z0 = kl_reference_point(kl_sum + 200.0, torch.tensor(7))  # shifted so z0 > 0 and the clamp is inactive
        batch = layout(*seqs(False), pad_id=0, packing=packing, packing_length=40)
        if packing:
            assert batch.input_ids.shape[0] < 7 and kl_batch.input_ids.shape[0] < 7  # really packed
        loss = kto_loss(sequence_logprobs(model, batch), ref, labels, z0, beta=0.1).mean()
        loss.backward()
        return kl_sum, z0, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    kl_pad, z_pad, loss_pad, g_pad = loss_and_grads(False)
    kl_pack, z_pack, loss_pack, g_pack = loss_and_grads(True)
    assert z_pad > 0
    torch.testing.assert_close(kl_pack, kl_pad, atol=1e-4, rtol=0)  # a sum of 7 log-probs near -30 each
    torch.testing.assert_close(z_pack, z_pad, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=0)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_teacher_prompts_show_the_privileged_context(tokenizer):
    """Self-distillation's teacher prompt (TRL's SDFT template, "{prompt}\\n\\n{privileged_context}"): a string
    prompt filled in; chat messages keep the system message and get the filled template as the last user message; a
    context given as messages joins their text; a row without the column is one line naming its row."""
    from verl_kit.data import Prompts, load_prompts, teacher_prompt, teacher_prompts

    template = "{prompt}\n\n{privileged_context}"
    assert teacher_prompt("What is 2 + 3?", "The answer is 5.", template) == "What is 2 + 3?\n\nThe answer is 5."
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    feedback = [{"role": "user", "content": "Wrong."}, {"role": "assistant", "content": "5 is right."}]
    assert teacher_prompt(chat, feedback, "{prompt} [hint: {privileged_context}]") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3? [hint: Wrong.\n5 is right.]"}]
    rows = [{"prompt": chat, "privileged_context": "5"}, {"prompt": "Say hi.", "privileged_context": "hi"}]
    ids = teacher_prompts(Prompts(rows, [[0], [0]]), tokenizer, template, 64, "data.jsonl")
    want = [[chat[0], {"role": "user", "content": "What is 2 + 3?\n\n5"}], "Say hi.\n\nhi"]
    assert ids == load_prompts([{"prompt": p} for p in want], tokenizer, 64, "x")
    with pytest.raises(UserError, match=r"^data.jsonl row 2: field 'privileged_context' is missing or empty"):
        teacher_prompts(Prompts([rows[0], {"prompt": "Say hi."}], [[0], [0]]), tokenizer, template, 64, "data.jsonl")
