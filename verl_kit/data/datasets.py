"""Datasets in, token ids out. Accepts TRL's formats as they are (standard or conversational, explicit or implicit
prompt), applies the tokenizer's chat template through TRL's helpers, truncates, and reports bad rows by file, row
number and field. Row numbers are 1-based, so for a .jsonl file they are line numbers."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from verl_kit.config import DataConfig
from verl_kit.errors import UserError

logger = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_split(name: str, split: str, config: str | None = None, required: bool = True):
    """Load one split of a hub dataset, a local file (.jsonl/.json/.parquet, whose only split is 'train') or a local
    directory of such files (splits named after the files). Split slicing such as 'train[:100]' is honoured.
    Returns a datasets.Dataset, or None when the split is missing and not `required`."""
    import datasets

    datasets.disable_progress_bars()
    base_split = split.split("[")[0]
    if os.path.isfile(name):
        builder = _BUILDERS.get(os.path.splitext(name)[1].lower())
        if builder is None:
            raise UserError(f"--dataset_name {name}: unsupported file type (use .jsonl, .json or .parquet)")
        if os.path.getsize(name) == 0:
            raise UserError(f"--dataset_name {name}: file is empty")
        if base_split != "train":
            if required:
                raise UserError(f"--dataset_name {name}: a single file has only the split 'train', not {split!r}")
            return None
        args, kwargs = (builder,), {"data_files": {"train": name}}
    elif os.path.isdir(name) or name.startswith((".", "/")):
        if not os.path.isdir(name):
            raise UserError(f"--dataset_name {name}: no such file or directory")
        args, kwargs = (name,), {}
    else:
        args, kwargs = (name, config), {}
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "corresponds to no data" in msg:
            raise UserError(f"--dataset_name {name}: split {split!r} is empty") from None
        if "split" in msg.lower() and not required:
            return None
        raise UserError(f"--dataset_name {name}: cannot load split {split!r}: {msg}") from None
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise UserError(f"--dataset_name {name}: cannot load it ({str(e).splitlines()[0]})") from None
    except StopIteration:
        raise UserError(f"--dataset_name {name}: no rows found") from None
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise UserError(f"--dataset_name {name}: cannot parse it ({str(cause).splitlines()[0]})") from None
    if len(ds) == 0:
        raise UserError(f"--dataset_name {name}: split {split!r} is empty")
    return ds


def load_splits(cfg: DataConfig) -> tuple:
    """(train, test) datasets of a recipe config: `--dataset_train_split` and `--dataset_test_split` of
    `--dataset_name`; test is None when the split is 'none' or the dataset has no such split. With `datasets:` (a
    mixture), load_mixture's."""
    if cfg.datasets:
        return load_mixture(cfg)
    train = load_split(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config)
    test = cfg.dataset_test_split and load_split(cfg.dataset_name, cfg.dataset_test_split, cfg.dataset_config,
                                                 required=False)
    return train, test or None


SOURCE = "data_source"  # the column naming each row's dataset in a mixture (verl's name for it)


def source_names(cfg: DataConfig) -> list[str]:
    """The name of each dataset of the mixture, as its rows' data_source: the path's last part without its extension
    (and the configuration name), the last two parts where two would be the same (arith/train, calc/train), numbered
    where they still are."""
    def name(d, parts: int) -> str:
        return "/".join(d.path.rstrip("/").split("/")[-parts:]).split(".")[0] + (f"/{d.name}" if d.name else "")

    names = [name(d, 1) for d in cfg.datasets]
    names = [n if names.count(n) == 1 else name(d, 2) for n, d in zip(names, cfg.datasets)]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def load_mixture(cfg: DataConfig) -> tuple:
    """(train, test) of a mixture, TRL 1.16's get_dataset: each dataset loaded (load_split for a local path or a hub
    name alone; datasets.load_dataset with data_dir/data_files), its `columns` selected, a `data_source` column
    added (source_names; a dataset that has one keeps its own), then, with fractions, the first round(w_k x N) rows
    of dataset k, w the normalised fractions and N the largest total no dataset is oversampled in; concatenated in
    order. `test_split_size` splits a held-out set off the mixture (seed 0: the same split every run); without it there
    is none. Datasets whose columns differ are one line naming both (select common ones with `columns`)."""
    import datasets

    parts = []
    for i, (d, label) in enumerate(zip(cfg.datasets, source_names(cfg))):
        where = f"datasets[{i}] ({d.path})"
        if d.data_files is None and d.data_dir is None:
            ds = load_split(d.path, d.split, d.name)
        else:
            try:
                ds = datasets.load_dataset(d.path, d.name, data_dir=d.data_dir, data_files=d.data_files, split=d.split)
            except Exception as e:  # noqa: BLE001 - datasets raises many kinds; one line naming the entry
                raise UserError(f"{where}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        if d.columns is not None:
            if missing := sorted(set(d.columns) - set(ds.column_names)):
                raise UserError(f"{where}: no column(s) {', '.join(missing)} (it has {', '.join(ds.column_names)})")
            ds = ds.select_columns(d.columns)
        if SOURCE not in ds.column_names:
            ds = ds.add_column(SOURCE, [label] * len(ds))
        parts.append((where, ds))
    fractions = [d.fraction for d in cfg.datasets]
    if fractions[0] is not None:
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(ds) / w for (_, ds), w in zip(parts, weights))
        parts = [(where, ds.select(range(round(w * total)))) for (where, ds), w in zip(parts, weights)]
        for where, ds in parts:
            if len(ds) == 0:
                raise UserError(f"{where}: its fraction keeps no row of a mixture of {round(total)}")
    first_where, first = parts[0]
    for where, ds in parts[1:]:
        if sorted(ds.column_names) != sorted(first.column_names):
            raise UserError(f"{where} has columns {sorted(ds.column_names)} but {first_where} has "
                            f"{sorted(first.column_names)}; keep the same ones with `columns:`")
    try:
        mixed = datasets.concatenate_datasets([ds.select_columns(first.column_names) for _, ds in parts])
    except ValueError as e:
        raise UserError(f"datasets: cannot mix them ({str(e).splitlines()[0]})") from None
    if cfg.test_split_size is None:
        return mixed, None
    size = cfg.test_split_size if cfg.test_split_size < 1 else int(cfg.test_split_size)
    try:
        split = mixed.train_test_split(test_size=size, seed=0)
    except ValueError as e:
        raise UserError(f"--test_split_size {cfg.test_split_size}: {str(e).splitlines()[0]}") from None
    return split["train"], split["test"]


def source_metrics(labels: list, names: list[str], scores=None) -> dict[str, float]:
    """data/source_share/<name>: each source's share of `labels` (the data_source of this process's samples of the
    step), and with `scores` (one per label) data/source_reward/<name>, its samples' mean score; over all processes
    (a collective: every process calls it with the same `names`); {} without names."""
    from verl_kit.train.distributed import reduce_metrics

    if not names:
        return {}
    scores = [float(x) for x in scores] if scores is not None else None
    sums = {"n": len(labels), **{f"n/{n}": sum(x == n for x in labels) for n in names}}
    if scores is not None:
        sums.update({f"r/{n}": sum(v for x, v in zip(labels, scores) if x == n) for n in names})
    t = reduce_metrics(sums)
    out = {f"data/source_share/{n}": t[f"n/{n}"] / max(t["n"], 1) for n in names}
    if scores is not None:
        out.update({f"data/source_reward/{n}": t[f"r/{n}"] / t[f"n/{n}"] for n in names if t[f"n/{n}"]})
    return out


@dataclass
class RowSources:
    """The data_source of each example of a split (`labels`) and the sources' names (sorted; the same on every
    process): what a recipe's per-step data/source_share/* metrics count."""

    labels: list[str]
    names: list[str]

    def metrics(self, idx: list[int]) -> dict[str, float]:
        """source_metrics of the examples `idx` (collective); {} without sources."""
        return source_metrics([self.labels[i] for i in idx], self.names) if self.names else {}


def row_sources(ds, n_examples: int) -> RowSources:
    """The RowSources of a split whose rows carry a data_source column (a mixture's, or the dataset's own), for
    `n_examples` examples made from its rows in order, k per row (KTO makes two of a preference pair); none (no
    metrics) without the column or when examples do not map to rows so."""
    if ds is None or SOURCE not in ds.column_names or n_examples % len(ds):
        return RowSources([], [])
    per_row = n_examples // len(ds)
    labels = [str(x) for x in ds[SOURCE] for _ in range(per_row)]
    return RowSources(labels, sorted(set(labels)))


_FINGERPRINTS: dict = {}


def train_fingerprint(cfg: DataConfig) -> str:
    """split_fingerprint of the run's train split, or of the mixed train rows of a mixture."""
    if not cfg.datasets:
        return split_fingerprint(cfg.dataset_name, cfg.dataset_train_split, cfg.dataset_config)
    import hashlib
    import json

    key = json.dumps([dataclasses.asdict(d) for d in cfg.datasets] + [cfg.test_split_size], sort_keys=True)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        for batch in load_mixture(cfg)[0].iter(batch_size=1000):
            h.update(json.dumps(batch, sort_keys=True, default=str).encode())
        _FINGERPRINTS[key] = h.hexdigest()[:16]
    return _FINGERPRINTS[key]


def split_fingerprint(name: str, split: str, config: str | None = None) -> str:
    """A content hash of one loaded split (load_split): sha256 over its rows as sorted-key JSON, in order, first 16
    hex digits. Two runs that read the same rows in the same order get the same value whatever the file is called;
    an edited, added or removed row changes it. Computed once per process and split."""
    import hashlib
    import json

    key = (name, split, config)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        for batch in load_split(name, split, config).iter(batch_size=1000):
            h.update(json.dumps(batch, sort_keys=True, default=str).encode())
        _FINGERPRINTS[key] = h.hexdigest()[:16]
    return _FINGERPRINTS[key]


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def _check_field(source: str, row_no: int, row: dict, key: str, required: bool = True) -> None:
    value = row.get(key)
    if value is None:
        if required:
            raise UserError(f"{source} row {row_no}: missing field {key!r}")
        return
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{source} row {row_no}: field {key!r} is empty")
    elif _is_messages(value):
        if not value or (key != "prompt" and not any(m["content"].strip() for m in value)):
            raise UserError(f"{source} row {row_no}: field {key!r} is empty")
    else:
        raise UserError(f"{source} row {row_no}: field {key!r} must be a string or a list of "
                        f"{{role, content}} messages, got {type(value).__name__}")


def _template_rows(rows: list[dict], tokenizer, source: str, completion_keys: tuple[str, ...]) -> list[dict]:
    """Rows as dicts of plain strings: implicit prompts extracted, chat templates applied (TRL helpers)."""
    from trl.data_utils import is_conversational, maybe_apply_chat_template, maybe_extract_prompt

    out = []
    for row_no, row in enumerate(rows, start=1):
        example = {k: row[k] for k in ("prompt", *completion_keys) if row.get(k) is not None}
        if "prompt" not in example:
            example = maybe_extract_prompt(example)
            if not example.get("prompt"):
                raise UserError(f"{source} row {row_no}: no 'prompt' field and the completions share no prefix "
                                "to extract one from")
        if is_conversational(example):
            if tokenizer.chat_template is None:
                raise UserError(f"{source} row {row_no}: conversational data needs a chat template, and the "
                                f"tokenizer of {tokenizer.name_or_path!r} has none")
            example = maybe_apply_chat_template(example, tokenizer)
        else:
            eos = tokenizer.eos_token or ""
            example = {k: (v if k == "prompt" or v.endswith(eos) else v + eos) for k, v in example.items()}
        out.append(example)
    return out


def _tokenize(texts: list[str], tokenizer) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def truncate(prompt: list, completions: list[list], max_prompt_length: int | None, max_length: int,
             source: str = "", row_no: int = 0) -> tuple[list, list[list], bool]:
    """The kit's one truncation rule (preference and unpaired data, SFT, online prompts): keep the last
    max_prompt_length prompt tokens, then cut each completion to fit max_length. A prompt that leaves no room for a
    completion is an error naming the row, never a silently empty response. Returns (prompt, completions, cut)."""
    cut = False
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt, cut = prompt[-max_prompt_length:], True
    room = max_length - len(prompt)
    if room < 1:
        raise UserError(f"{source} row {row_no}: prompt is {len(prompt)} tokens, leaving no room for the completion "
                        f"within --max_length {max_length} (raise it, or set --max_prompt_length to truncate prompts)")
    if any(len(c) > room for c in completions):
        completions, cut = [c[:room] for c in completions], True
    return prompt, completions, cut


@dataclass
class PreferenceExample:
    """One preference pair, as token ids. prompt_ids (P,), chosen_ids (C,), rejected_ids (Rj,)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    @property
    def cost(self) -> int:
        """Tokens of the pair's two forward passes (prompt + chosen, prompt + rejected): what micro-batches pack by."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


def preference_examples(ds, tokenizer, max_prompt_length: int | None, max_length: int,
                        source: str) -> list[PreferenceExample]:
    """Validate, template and tokenize a preference dataset (fields prompt?, chosen, rejected)."""
    rows = list(ds)
    for row_no, row in enumerate(rows, start=1):
        for key, required in (("prompt", False), ("chosen", True), ("rejected", True)):
            _check_field(source, row_no, row, key, required)
    texts = _template_rows(rows, tokenizer, source, ("chosen", "rejected"))
    prompts = _tokenize([t["prompt"] for t in texts], tokenizer)
    chosen = _tokenize([t["chosen"] for t in texts], tokenizer)
    rejected = _tokenize([t["rejected"] for t in texts], tokenizer)
    bos = tokenizer.bos_token_id
    out, n_cut = [], 0
    for row_no, (p, c, r) in enumerate(zip(prompts, chosen, rejected), start=1):
        if bos is not None and (not p or p[0] != bos):
            p = [bos] + p
        if not c or not r:
            raise UserError(f"{source} row {row_no}: field {'chosen' if not c else 'rejected'!r} is empty after "
                            "tokenization")
        p, (c, r), cut = truncate(p, [c, r], max_prompt_length, max_length, source, row_no)
        n_cut += cut
        out.append(PreferenceExample(p, c, r))
    if n_cut:
        logger.warning("%s: %d of %d rows truncated to --max_prompt_length %s / --max_length %d",
                       source, n_cut, len(out), max_prompt_length, max_length)
    return out


@dataclass
class UnpairedExample:
    """One completion labelled desirable (True) or undesirable (False), as token ids. prompt_ids (P,),
    completion_ids (C,)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool


def unpaired_examples(ds, tokenizer, max_prompt_length: int | None, max_length: int, source: str,
                      unpair: bool = True) -> list[UnpairedExample]:
    """Validate, template and tokenize an unpaired dataset (TRL's format: prompt, completion, boolean label).
    A paired preference dataset (prompt?, chosen, rejected) is converted when `unpair` is set, as TRL's
    `unpair_preference_dataset` does: row i becomes examples 2i (chosen, desirable) and 2i+1 (rejected, undesirable)."""
    rows = list(ds)
    paired = "completion" not in rows[0] and ("chosen" in rows[0] or "rejected" in rows[0])
    if paired and not unpair:
        raise UserError(f"{source}: a paired preference dataset (chosen/rejected); pass --unpair_preference_dataset "
                        "true to use chosen as desirable and rejected as undesirable")
    keys = ("chosen", "rejected") if paired else ("completion",)
    for row_no, row in enumerate(rows, start=1):
        for key in ("prompt", *keys):
            _check_field(source, row_no, row, key, required=key != "prompt" or not paired)
        if not paired and not isinstance(row.get("label"), bool):
            if row.get("label") is None:
                raise UserError(f"{source} row {row_no}: missing field 'label'")
            raise UserError(f"{source} row {row_no}: field 'label' must be true or false, got "
                            f"{type(row['label']).__name__} {row['label']!r}")
    texts = _template_rows(rows, tokenizer, source, keys)
    prompts = _tokenize([t["prompt"] for t in texts], tokenizer)
    completions = list(zip(*[_tokenize([t[k] for t in texts], tokenizer) for k in keys]))
    labels = [(True, False)] * len(rows) if paired else [(row["label"],) for row in rows]
    bos = tokenizer.bos_token_id
    out, n_cut = [], 0
    for row_no, (p, cs, ls) in enumerate(zip(prompts, completions, labels), start=1):
        if bos is not None and (not p or p[0] != bos):
            p = [bos] + p
        for key, c in zip(keys, cs):
            if not c:
                raise UserError(f"{source} row {row_no}: field {key!r} is empty after tokenization")
        p, cs, cut = truncate(p, list(cs), max_prompt_length, max_length, source, row_no)
        n_cut += cut
        out.extend(UnpairedExample(p, c, label) for c, label in zip(cs, ls))
    if n_cut:
        logger.warning("%s: %d of %d rows truncated to --max_prompt_length %s / --max_length %d",
                       source, n_cut, len(rows), max_prompt_length, max_length)
    return out


def mismatched_partners(prompts: list[list[int]], seed: int) -> list[int]:
    """For each example i, the example j(i) whose completion is paired with prompt i to estimate KTO's KL term.
    j is a seeded cyclic shift of a random order: j(i) != i, every completion is used about once, and the shift
    is lengthened where it would land on the same prompt (paired data unpaired: siblings share their prompt)."""
    import torch

    n = len(prompts)
    if n < 2:
        raise UserError(f"KTO's KL estimate pairs each prompt with another example's completion: a split needs at "
                        f"least 2 examples, got {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    partner = [0] * n
    for k, i in enumerate(order):
        shifts = (order[(k + s) % n] for s in range(1, min(n, 16)))
        partner[i] = next((j for j in shifts if prompts[j] != prompts[i]), order[(k + 1) % n])
    return partner
