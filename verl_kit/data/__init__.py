"""Datasets in TRL's formats -> token ids: loading and bad-row errors, the online recipes' prompts, SFT formatting,
packing (TokenBatch, packed or padded layout), the embedded tasks."""

from verl_kit.data.datasets import (
    SOURCE,
    PreferenceExample,
    RowSources,
    UnpairedExample,
    load_split,
    load_splits,
    mismatched_partners,
    preference_examples,
    row_sources,
    source_metrics,
    split_fingerprint,
    train_fingerprint,
    unpaired_examples,
)
from verl_kit.data.packing import (
    TokenBatch,
    layout,
    layout_cost,
    logprobs_from_logits,
    pack_balanced,
    pack_rows,
    split_by_tokens,
)
from verl_kit.data.prompts import (
    PRIVILEGED,
    Prompts,
    TeacherPrompts,
    load_prompt_splits,
    load_prompts,
    teacher_prompt,
    teacher_prompts,
)
from verl_kit.data.sft import TINY_SFT, SFTExample, sft_examples, sft_format, truncate, write_sft_data
from verl_kit.data.tasks import (
    ARITH,
    ARITH_INSTRUCTION,
    ASSETS,
    arith_problems,
    arith_row,
    arith_splits,
    main,
    write_arith,
    write_jsonl,
)
