"""Every accepted preference format, and every bad input, with the one-line error it must give."""

import json

import pytest

from verl_kit.data import load_split, preference_examples
from verl_kit.errors import UserError

CONV = {"prompt": [{"role": "user", "content": "Tell me about the sea."}],
        "chosen": [{"role": "assistant", "content": "The sea is lovely."}],
        "rejected": [{"role": "assistant", "content": "The sea is dull."}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


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
