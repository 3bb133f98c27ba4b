"""verl_kit.data.sft: TRL's three SFT formats and their loss masks, truncation, bad input as one line; packed ==
padded loss and gradients, and the token mean independent of the split. (recipes/sft.py as a user runs it:
tests/recipes/test_sft_runs.py.)"""

import json

import pytest
import torch

from verl_kit.algos import global_mean_share
from verl_kit.data import TINY_SFT, layout, load_split, sft_examples, truncate
from verl_kit.errors import UserError
from verl_kit.models import load_causal_lm
from verl_kit.train import token_logprobs

USER = {"role": "user", "content": "Tell me about the sea."}
REPLY = {"role": "assistant", "content": "The sea is lovely."}


def examples(tmp_path, rows, tokenizer, max_prompt_length=64, max_length=128, **flags):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sft_examples(load_split(str(path), "train"), tokenizer, max_prompt_length, max_length, str(path), **flags)


def learned_text(tokenizer, ex):
    return tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])


# ---- data: formats, masks, truncation, bad rows ------------------------------------------------------------------


def test_messages_learn_every_assistant_turn_only(tmp_path, tokenizer):
    """Two assistant turns: both replies and their end tokens are learned, the user turns and the generation prompts
    are not; the token ids are those of the whole rendered conversation."""
    conv = [USER, REPLY, {"role": "user", "content": "And the river?"}, {"role": "assistant", "content": "Calm."}]
    (ex,) = examples(tmp_path, [{"messages": conv}], tokenizer)
    assert learned_text(tokenizer, ex) == "The sea is lovely.<|end|>Calm.<|end|>"
    rendered = tokenizer.apply_chat_template(conv, tokenize=False)
    assert ex.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    (whole,) = examples(tmp_path, [{"messages": conv}], tokenizer, assistant_only_loss=False)
    assert whole.input_ids == ex.input_ids and whole.loss_mask == [False] + [True] * (len(ex.input_ids) - 1)


def test_prompt_completion_standard_and_conversational(tmp_path, tokenizer):
    """Standard rows get EOS appended to the completion (TRL does the same); conversational rows go through the chat
    template with the generation prompt ending the prompt. Only the completion is learned unless told otherwise."""
    (std,) = examples(tmp_path, [{"prompt": "The sky is", "completion": " blue."}], tokenizer)
    assert learned_text(tokenizer, std) == " blue.<|end|>"
    (conv,) = examples(tmp_path, [{"prompt": [USER], "completion": [REPLY]}], tokenizer)
    rendered = "<|user|>Tell me about the sea.<|end|><|assistant|>The sea is lovely.<|end|>"
    assert tokenizer.decode(conv.input_ids) == rendered
    assert learned_text(tokenizer, conv) == "The sea is lovely.<|end|>"
    (whole,) = examples(tmp_path, [{"prompt": [USER], "completion": [REPLY]}], tokenizer, completion_only_loss=False)
    assert sum(whole.loss_mask) == len(whole.input_ids) - 1  # every token but the first, which nothing predicts


def test_text_rows_learn_everything(tmp_path, tokenizer):
    (ex,) = examples(tmp_path, [{"text": "The sea is lovely."}], tokenizer)
    assert tokenizer.decode(ex.input_ids) == "The sea is lovely.<|end|>"
    assert ex.loss_mask == [False] + [True] * (len(ex.input_ids) - 1)


def test_truncation_keeps_the_end_of_the_prompt_and_the_start_of_the_rest():
    """ids 0..9, learned from 6 on: max_prompt_length 3 keeps prompt 3,4,5; max_length 5 then keeps 3..7."""
    ids, mask = list(range(10)), [False] * 6 + [True] * 4
    assert truncate(ids, mask, 3, 5) == ([3, 4, 5, 6, 7], [False] * 3 + [True] * 2, True)
    assert truncate(ids, mask, 8, 20) == (ids, mask, False)


@pytest.mark.parametrize("rows, flags, expected", [
    ([{"messages": [USER, REPLY]}, {"messages": [USER]}], {},
     "row 2: field 'messages' has no assistant turn to learn from"),
    ([{"messages": [USER, REPLY]}, {"messages": "hi"}], {},
     "row 2: field 'messages' must be a list of {role, content} messages, got str"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}], {}, "row 2: field 'completion' is empty"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], {}, "row 2: missing field 'completion'"),
    ([{"question": "a"}], {}, "no SFT fields: expected 'text' (--dataset_text_field), 'prompt' + 'completion', or "
                              "'messages'; the data has 'question'"),
    ([{"text": "a"}], {"completion_only_loss": True}, "--completion_only_loss true needs prompt/completion rows"),
    ([{"prompt": "a", "completion": "b"}], {"assistant_only_loss": True}, "--assistant_only_loss true needs"),
    ([{"text": "ok"}, {"text": "<|end|>"}, {"text": "fine"}, {"text": "<|end|>"}], {},
     "2 of 4 rows have no token left to learn after tokenization and truncation to --max_prompt_length 64 / "
     "--max_length 128 (rows 2, 4)"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer, rows, flags, expected):
    with pytest.raises(UserError) as e:
        examples(tmp_path, rows, tokenizer, **flags)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg
    assert "row" not in expected or str(tmp_path / "d.jsonl") in msg


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, tokenizer):
    """A template that renders earlier assistant turns differently from the last one (as thinking models drop old
    reasoning) hides where the assistant tokens are: one line naming the row."""
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>..."
                         "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    conv = [USER, REPLY, USER, REPLY]
    with pytest.raises(UserError, match=r"row 1: the chat template does not render message 3"):
        examples(tmp_path, [{"messages": conv}], tok)


# ---- maths: packed == padded, and the token mean does not depend on the split ------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_path):
    torch.manual_seed(0)
    m = load_causal_lm(tiny_model_path, attn_implementation="sdpa")
    with torch.no_grad():  # away from init, so logits are not nearly uniform
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.fixture(scope="module")
def task(tokenizer):
    return sft_examples(load_split(TINY_SFT, "test[:12]"), tokenizer, 64, 128, "tiny_sft")


def sft_loss_and_grads(model, exs, chunks, packing, n_tokens):
    """The recipe's reduction on one process: sum over micro-batches of global_mean_share(nll, n_tokens, 1)."""
    model.zero_grad()
    total = 0.0
    for chunk in chunks:
        batch = layout([exs[i].input_ids for i in chunk], [exs[i].loss_mask for i in chunk], pad_id=0,
                       packing=packing, packing_length=64)
        logps, _ = token_logprobs(model, batch)
        loss = global_mean_share(-logps, n_tokens, 1)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_sft_loss_and_grads_equal_padded_and_any_split(model, task):
    n_tokens = sum(sum(e.loss_mask) for e in task)
    packed = layout([e.input_ids for e in task], [e.loss_mask for e in task], 0, packing=True, packing_length=64)
    assert packed.input_ids.shape[0] <= len(task) / 2  # really packed: two or more sequences per row
    everything = [list(range(len(task)))]
    loss_pad, g_pad = sft_loss_and_grads(model, task, everything, False, n_tokens)
    loss_pack, g_pack = sft_loss_and_grads(model, task, everything, True, n_tokens)
    uneven = [[0, 5], [1, 2, 3, 4, 6], [7, 8, 9, 10, 11]]  # micro-batches of different token counts
    loss_split, g_split = sft_loss_and_grads(model, task, uneven, True, n_tokens)
    assert loss_pad > 1.0  # a real loss, not a degenerate one
    for loss, grads in ((loss_pack, g_pack), (loss_split, g_split)):
        assert loss == pytest.approx(loss_pad, abs=1e-5)
        for name in g_pad:
            torch.testing.assert_close(grads[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)
