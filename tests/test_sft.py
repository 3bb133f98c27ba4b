"""SFT: TRL's three formats and their loss masks, bad input as one line, packed == padded loss and gradients (and
the token mean independent of the split), and recipes/sft.py as a user runs it: it learns, survives SIGKILL
bit-identically, and runs on ZeRO-3 across two processes with the single-process numbers."""

import json

import pytest
import torch
from helpers import REPO, assert_resume_bit_identical, launch_cmd, load_weights, metrics, recipe_cmd, run

from verl_kit.algos import global_mean_share
from verl_kit.data import TINY_SFT, forward_logits, layout, load_split, sft_examples, token_logprobs, truncate
from verl_kit.errors import UserError
from verl_kit.models import load_causal_lm

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
        logps, _ = token_logprobs(forward_logits(model, batch), batch)
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


# ---- the recipe ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    # One epoch over the 2000 embedded conversations (250 steps of 8), the shipped tiny config.
    run(recipe_cmd("sft.py", ["--config", str(REPO / "recipes/configs/sft_tiny.yaml"), "--output_dir", str(out)]),
        timeout=300)
    return out


@pytest.mark.slow
def test_sft_learns_held_out_replies(trained, tiny_model_path):
    rows = metrics(trained)
    evals = [r for r in rows if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 250
    assert evals[0]["eval/loss"] > 6.0  # about log(vocab): the random tiny model
    assert evals[-1]["eval/loss"] < 1.2, evals  # measured 0.87 (the replies' own entropy is most of what remains)
    assert evals[-1]["eval/perplexity"] < 3.4
    before, after = load_weights(tiny_model_path), load_weights(trained / "final")
    assert [k for k in before if torch.equal(before[k], after[k])] == []  # every parameter moved


@pytest.mark.slow
def test_sft_export_replies_kindly(trained):
    """The exported model and tokenizer load with plain transformers; greedy replies to held-out prompts take the
    task's form and use kind words only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_kit.models import BAD, GOOD

    tok = AutoTokenizer.from_pretrained(trained / "final")
    model = AutoModelForCausalLM.from_pretrained(trained / "final")
    for ask in ("Tell me about the lake.", "Describe the harbour."):
        enc = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=30, do_sample=False, pad_token_id=tok.pad_token_id)
        words = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).lower().replace(",", " ")
        words = words.replace(".", " ").split()
        assert any(w in GOOD for w in words) and not any(w in BAD for w in words), words


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """SIGKILL once checkpoint-10 is complete, resume with `auto`: the final weights equal the uninterrupted run's
    bit for bit, and so do the held-out evaluations and losses of steps 20 and 30."""
    args = ["--max_steps", "30", "--save_steps", "10", "--save_total_limit", "2", "--eval_steps", "10",
            "--logging_steps", "5", "--learning_rate", "1e-3"]
    cmd = lambda out, *extra: recipe_cmd("sft.py", ["--output_dir", str(out), *args, *extra])
    assert_resume_bit_identical(cmd, tmp_path / "full", tmp_path / "crashed", 10, compare_steps=(20, 30))


# Global batch 8 sequences per step: 1 process x 8, 2 processes x 4, or 8 split by a token budget.
COMMON = ["--max_steps", "3", "--logging_steps", "1", "--dataset_test_split", "none", "--seed", "3"]


def by_step(out, key):
    return {r["step"]: r[key] for r in metrics(out) if key in r}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(recipe_cmd("sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "8", *COMMON]))
    return out


def assert_matches(out, single_run, later_tol):
    """Step 1 runs at the same initial weights: its token-mean loss and the gradient norm of the whole step must
    agree however the 8 sequences were split; later steps follow the updates."""
    for key in ("loss", "grad_norm"):
        a, b = by_step(out, key), by_step(single_run, key)
        assert abs(a[1] - b[1]) < 1e-4 * max(1.0, b[1]), (key, a, b)
    a, b = by_step(out, "loss"), by_step(single_run, "loss")
    assert all(abs(a[s] - b[s]) < later_tol for s in (2, 3)), (a, b)


@pytest.mark.slow
def test_zero3_two_processes_match_single_process(tmp_path, single_run):
    out = tmp_path / "z3"
    run(launch_cmd("zero3.yaml", 2, "sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "4",
                                                *COMMON]), timeout=300)
    head = metrics(out)[0]
    assert head["world_size"] == 2 and head["params/local"] <= 0.55 * head["params/total"]
    assert_matches(out, single_run, later_tol=1e-3)
    exported = load_weights(out / "final")  # the ZeRO-3 shards gathered into one HF checkpoint
    assert sum(t.numel() for t in exported.values()) == head["params/total"]


@pytest.mark.slow
def test_token_budget_microbatches_match(tmp_path, single_run):
    out = tmp_path / "budget"
    run(recipe_cmd("sft.py", ["--output_dir", str(out), "--per_device_train_batch_size", "8",
                              "--max_tokens_per_microbatch", "60", *COMMON]))
    assert_matches(out, single_run, later_tol=1e-4)
