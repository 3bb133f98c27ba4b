"""Supervised fine-tuning data (recipes/sft.py).

SFT rows are TRL's formats, as they are (the first row decides which):

    text                  {"text": "..."}                            language modeling: every token is learned
    prompt + completion   {"prompt": ..., "completion": ...}         standard or conversational (TRL's helpers apply
                                                                     the chat template); the completion is learned
    messages              {"messages": [{"role", "content"}, ...]}   the chat template renders the conversation; the
                                                                     assistant turns are learned

Each row becomes one SFTExample: token ids and a loss mask. `--completion_only_loss` / `--assistant_only_loss` (TRL's
names) pick what is learned: None (the default) learns the completion, resp. the assistant turns, when the data has
them; false learns the whole sequence. Assistant tokens are found without `{% generation %}` tags: the conversation is
rendered turn by turn, and each assistant turn is the text its message adds after the generation prompt, so any chat
template that renders a conversation as the concatenation of its turns works (a one-line error names the row where
one does not). Every piece is tokenized on its own, as prompt and completion are for DPO and as a generated reply is.

Truncation, the kit's one rule (datasets.truncate): the tokens before the first learned token (the prompt) keep their
last `max_prompt_length`, then the sequence is cut at `max_length`. Regenerate the embedded SFT task (the tone task's
prompts with the kind replies, as `messages`) with `python -m verl_kit.data sft`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from verl_kit.data.datasets import _check_field, _template_rows, _tokenize
from verl_kit.data.datasets import truncate as truncate_rule
from verl_kit.errors import UserError
from verl_kit.models.tiny import ASSETS, make_preference_rows

logger = logging.getLogger(__name__)

TINY_SFT = str(ASSETS / "tiny_sft")  # directory with train.jsonl and test.jsonl (`messages`)


@dataclass
class SFTExample:
    """One training sequence. input_ids (T,); loss_mask (T,) bool, token t is learned (predicted from t-1; the first
    token never is, so sum(loss_mask) is the number of learned tokens)."""

    input_ids: list[int]
    loss_mask: list[bool]


def sft_format(row: dict, source: str, text_field: str = "text") -> str:
    """'messages', 'prompt-completion' or 'text', from a row's fields."""
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    if text_field in row:
        return "text"
    raise UserError(f"{source}: no SFT fields: expected {text_field!r} (--dataset_text_field), 'prompt' + "
                    f"'completion', or 'messages'; the data has {', '.join(map(repr, row)) or 'no columns'}")


def _conversation(messages: list[dict], tokenizer, source: str, row_no: int) -> list[tuple[str, bool]]:
    """The chat template's rendering of `messages` as (text, is_assistant_turn) pieces whose concatenation is the
    whole rendering. An assistant piece starts after the generation prompt and ends where the next message starts."""
    def render(msgs, generation_prompt=False):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:
            raise UserError(f"{source} row {row_no}: the chat template failed on the conversation "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    pieces, done = [], ""
    for k, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        head = render(messages[:k], generation_prompt=True) if assistant else done
        text = render(messages[:k + 1])
        if not (head.startswith(done) and text.startswith(head)):
            raise UserError(f"{source} row {row_no}: the chat template does not render message {k + 1} as an "
                            "addition to the messages before it, so the assistant tokens cannot be located; use "
                            "prompt/completion rows or --assistant_only_loss false")
        pieces += [(head[len(done):], False), (text[len(head):], assistant)]
        done = text
    return [(t, a) for t, a in pieces if t]


def sft_examples(ds, tokenizer, max_prompt_length: int, max_length: int, source: str, text_field: str = "text",
                 completion_only_loss: bool | None = None,
                 assistant_only_loss: bool | None = None) -> list[SFTExample]:
    """Validate, template, tokenize and truncate an SFT dataset (see the module docstring). Bad rows raise a one-line
    UserError naming `source`, the row number (1-based: the line of a .jsonl) and the field."""
    rows = list(ds)
    fmt = sft_format(rows[0], source, text_field)
    if completion_only_loss and fmt != "prompt-completion":
        raise UserError(f"--completion_only_loss true needs prompt/completion rows; {source} has {fmt!r} rows")
    if assistant_only_loss and fmt != "messages":
        raise UserError(f"--assistant_only_loss true needs 'messages' rows; {source} has {fmt!r} rows "
                        "(prompt/completion rows: --completion_only_loss)")
    # learn only the completion / the assistant turns, unless the flag says false; text rows: learn everything
    learn_part = {"prompt-completion": completion_only_loss is not False, "messages": assistant_only_loss is not False,
                  "text": False}[fmt]
    keys = {"messages": ("messages",), "prompt-completion": ("prompt", "completion"), "text": (text_field,)}[fmt]
    for row_no, row in enumerate(rows, start=1):
        for key in keys:
            _check_field(source, row_no, row, key)
        if fmt == "messages" and not isinstance(row["messages"], list):
            raise UserError(f"{source} row {row_no}: field 'messages' must be a list of {{role, content}} messages, "
                            f"got {type(row['messages']).__name__}")
        if fmt == "messages" and learn_part and not any(m["role"] == "assistant" for m in row["messages"]):
            raise UserError(f"{source} row {row_no}: field 'messages' has no assistant turn to learn from "
                            "(or pass --assistant_only_loss false to learn the whole conversation)")
        if fmt == "text" and not isinstance(row[text_field], str):
            raise UserError(f"{source} row {row_no}: field {text_field!r} must be a string")
    if fmt == "messages":
        if tokenizer.chat_template is None:
            raise UserError(f"{source}: 'messages' rows need a chat template, and the tokenizer of "
                            f"{tokenizer.name_or_path!r} has none")
        pieces = [_conversation(row["messages"], tokenizer, source, row_no) for row_no, row in enumerate(rows, 1)]
    elif fmt == "prompt-completion":
        pieces = [[(t["prompt"], False), (t["completion"], True)]
                  for t in _template_rows(rows, tokenizer, source, ("completion",))]
    else:
        eos = tokenizer.eos_token or ""
        pieces = [[(row[text_field] if row[text_field].endswith(eos) else row[text_field] + eos, True)]
                  for row in rows]
    flat = _tokenize([t for p in pieces for t, _ in p], tokenizer)
    bos = tokenizer.bos_token_id
    out, n_cut, empty, j = [], 0, [], 0
    for row_no, parts in enumerate(pieces, start=1):
        ids, mask = [], []
        for _, learned in parts:
            ids += flat[j]
            mask += [learned or not learn_part] * len(flat[j])
            j += 1
        if bos is not None and (not ids or ids[0] != bos):
            ids, mask = [bos] + ids, [False] + mask
        ids, mask, cut = truncate(ids, mask, max_prompt_length, max_length)
        n_cut += cut
        if not any(mask):
            empty.append(row_no)
        out.append(SFTExample(ids, mask))
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
        raise UserError(f"{source}: {len(empty)} of {len(rows)} rows have no token left to learn after tokenization "
                        f"and truncation to --max_prompt_length {max_prompt_length} / --max_length {max_length} "
                        f"(rows {shown})")
    if n_cut:
        logger.warning("%s: %d of %d rows truncated to --max_prompt_length %s / --max_length %d",
                       source, n_cut, len(out), max_prompt_length, max_length)
    return out


def truncate(ids: list[int], mask: list[bool], max_prompt_length: int, max_length: int
             ) -> tuple[list[int], list[bool], bool]:
    """The prompt (tokens before the first learned one) keeps its last max_prompt_length tokens, then the sequence
    keeps its first max_length. The first token is never learned (nothing predicts it). Returns (ids, mask, cut)."""
    first = next((t for t, m in enumerate(mask) if m and t > 0), len(ids))
    positions = list(range(len(ids)))  # the rule cuts positions; ids and mask follow
    prompt, (completion,), cut = truncate_rule(positions[:first], [positions[first:]], max_prompt_length, max_length)
    keep = prompt + completion
    return [ids[i] for i in keep], [False] + [mask[i] for i in keep][1:], cut


def write_sft_data(out_dir: str = TINY_SFT, n_train: int = 2000, n_test: int = 200) -> None:
    """The embedded SFT task: the tone task's prompts (models.tiny, same seeds, so the same train/test split as the
    preference data) with their kind replies, as `messages`."""
    os.makedirs(out_dir, exist_ok=True)
    for split, n, seed in [("train", n_train, 0), ("test", n_test, 1)]:
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for row in make_preference_rows(n, seed):
                f.write(json.dumps({"messages": row["prompt"] + row["chosen"]}) + "\n")
