"""The online recipes' prompts: each dataset row's `prompt` as token ids (a string, or chat messages rendered with
the generation prompt), kept beside the row, for the train and held-out splits."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from verl_kit.config import DataConfig
from verl_kit.data.datasets import SOURCE, load_splits, truncate
from verl_kit.errors import UserError

PRIVILEGED = "privileged_context"  # TRL's column: what only the teacher reads (a reference solution, feedback)


@dataclass
class Prompts:
    """A split of prompts: the dataset `rows` (dicts: `prompt` and the other columns the rewards may read) and their
    token `ids` (the prompt rendered with the chat template, truncated)."""

    rows: list[dict]
    ids: list[list[int]]

    @functools.cached_property
    def sources(self) -> list[str]:
        """The rows' data_source names (the datasets of a mixture), sorted; [] without the column."""
        return sorted({str(r[SOURCE]) for r in self.rows if SOURCE in r})

    @staticmethod
    def each(items: list, n: int) -> list:
        """Each sample's prompt when every prompt of `items` (indices or token ids) gets n of them, a group:
        items[0] n times, then items[1]... (the one order of a batch's samples: backends, runners, Rollouts)."""
        return [x for x in items for _ in range(n)]


def load_prompt_splits(cfg: DataConfig, tokenizer) -> tuple[Prompts, Prompts]:
    """The train and held-out prompts of a recipe config (the held-out set is empty without a test split)."""
    train_ds, test_ds = load_splits(cfg)
    splits = []
    for ds, source in ((train_ds, cfg.train_source), (test_ds, cfg.test_source)):
        rows = list(ds) if ds is not None else []
        splits.append(Prompts(rows, load_prompts(rows, tokenizer, cfg.max_prompt_length, source)))
    return splits[0], splits[1]


def load_prompts(ds, tokenizer, max_prompt_length: int, source: str) -> list[list[int]]:
    """Token ids of each row's `prompt` (a string, or chat messages rendered with the generation prompt); prompts
    longer than max_prompt_length keep their last tokens."""
    out = []
    for row_no, row in enumerate(ds, start=1):
        prompt = row.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        elif isinstance(prompt, str) and prompt.strip():
            text = prompt
        else:
            raise UserError(f"{source} row {row_no}: field 'prompt' must be a non-empty string or chat messages")
        ids, _, _ = truncate(tokenizer(text, add_special_tokens=False)["input_ids"], [], max_prompt_length,
                             max_prompt_length + 1, source, row_no)  # the prompt part of the one rule
        out.append(ids)
    return out


def teacher_prompt(prompt, context, template: str):
    """The prompt the teacher reads (TRL's SDFT, DemonstrationTeacherContextBuilder): `template` filled with the
    prompt and the row's privileged context; with chat messages the last user message's text is replaced by the
    filled template (the system and earlier messages kept). A context given as messages is joined by their text."""
    if isinstance(context, list):
        context = "\n".join(str(m.get("content", "")) for m in context if isinstance(m, dict) and m.get("content"))
    if isinstance(prompt, list):
        *before, last = prompt
        return [*before, {**last, "content": template.format(prompt=last.get("content", ""),
                                                             privileged_context=context)}]
    return template.format(prompt=prompt, privileged_context=context)


def teacher_prompts(prompts: Prompts, tokenizer, template: str, max_prompt_length: int, source: str
                    ) -> list[list[int]]:
    """Token ids of each row's teacher prompt (teacher_prompt), aligned with `prompts.ids`; a row without a
    non-empty `privileged_context` is a UserError naming it. Longer than max_prompt_length: the last tokens kept."""
    rows = []
    for row_no, row in enumerate(prompts.rows, start=1):
        context = row.get(PRIVILEGED)
        if context is None or (isinstance(context, str | list) and not context):
            raise UserError(f"{source} row {row_no}: field '{PRIVILEGED}' is missing or empty: self-distillation "
                            "shows it to the teacher (a reference solution, feedback)")
        rows.append({"prompt": teacher_prompt(row.get("prompt"), context, template)})
    return load_prompts(rows, tokenizer, max_prompt_length, source)


class TeacherPrompts:
    """What a distillation teacher reads of a rollout: the same responses after its own prompts, each row's
    teacher_prompt showing its privileged_context. `splits`: (prompts, source) pairs, the train split first, then the
    held-out one; the teacher prompts are rendered once, here (truncated to `max_prompt_length`)."""

    def __init__(self, tokenizer, template: str, max_prompt_length: int, *splits: tuple[Prompts, str]):
        self.ids = [teacher_prompts(p, tokenizer, template, max_prompt_length, source) for p, source in splits]

    def view(self, ro, split: int = 0):
        """`ro` (a rollout.Rollout drawn from splits[split]) with the teacher's prompts in place of the student's."""
        ids = self.ids[split]
        return dataclasses.replace(ro, prompt_ids=[ids[i] for i in ro.prompt_index])
