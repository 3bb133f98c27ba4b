"""Rewards: sequence scores (B,) for the decoded responses, from Python functions and/or a reward model.

Reward functions are named on the command line as `module:function` or `path/to/file.py:function` and return one
finite number per completion. They are called the way TRL's GRPOTrainer calls them: `prompts` (the dataset's prompt
fields as they are, a string or chat messages), `completions` (the decoded responses, special tokens removed) and,
as keyword arguments, the dataset's other columns, one value per completion (a prompt row's values repeated for each
of its generations), plus `completion_ids` (each response's token ids) when the caller has them (Rewards.of_rollout).
What a function receives follows its signature:

    def reward(prompts, completions): ...                       # the two lists only
    def reward(prompts, completions, answer): ...               # + the `answer` column (a missing one: UserError)
    def reward(completions, answer, **kwargs): ...              # TRL style: everything by keyword, all the columns
    def reward(p, c, **kwargs): ...                             # lists positionally (no `completions` name) + all

A function whose parameters include `completions` is called with keywords only (`prompts=`, `completions=`, each
column it names or all of them if it takes **kwargs), as TRL does; otherwise the two lists go positionally. TRL's
`trainer_state`, `log_extra`, `log_metric` and `environments` keys do not exist here. Columns named `prompts`,
`completions` or `completion_ids` are refused. A wrong count, a non-finite value or an exception is a one-line
UserError naming the function and the sample (the batch is retried one sample at a time, columns sliced alike).
`async def` functions are awaited once per sample, concurrently; with CallLimits (the --reward_timeout_s,
--reward_max_concurrency and --reward_fallback flags) a call that times out or raises, or a non-finite value, scores
the fallback instead, counted (docs/algorithms.md, "Rewards that cannot stall a run"). A call past its timeout is
interrupted where it is, on the main thread, leaving nothing running (verl_kit.deadline).

Built-in functions: `kind_reply` (the embedded task, the online recipes' default reward), `kind_words` (the share of
kind words, won by shortening replies), `math_answer` (1.0 when the completion's final answer equals the row's `answer`
or `solution` according to HF math-verify), `final_number` (math_answer on the last written-out number),
`boxed_format` (1.0 for exactly one non-empty \\boxed{...}) and `soft_overlong_punishment` (DAPO's length penalty,
0 to -1; `get_soft_overlong_punishment` makes one for other lengths). `reward_columns(rows)` turns dataset rows, one
per response, into the columns dict.

A reward model is an HF sequence-classification model with its *own* tokenizer: the policy's text is decoded and
re-tokenized with the reward tokenizer and its chat template, so policy and reward model need not share a vocabulary.
Reward models see prompts and completions only.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass

import torch

from verl_kit.config import load_object
from verl_kit.deadline import DeadlineExceeded, call_with_deadline
from verl_kit.errors import UserError
from verl_kit.models.tiny import BAD, GOOD


def kind_words(prompts, completions) -> list[float]:
    """The share of a response's words that are kind adjectives (models.tiny.GOOD). A two-word reply of one kind
    word scores 0.5: policies learn to shorten their replies (the benchmarks' reward; the demo uses kind_reply)."""
    out = []
    for text in completions:
        words = re.findall(r"[a-z]+", text.lower())
        out.append(sum(w in GOOD for w in words) / max(len(words), 1))
    return out


def kind_reply(prompts, completions) -> list[float]:
    """The embedded task: a reply earns 1/4 for each *different* kind adjective it uses (models.tiny.GOOD, up to
    four) and loses 1/4 for each dismissive one (BAD), floored at 0. Shortening a reply cannot raise it, repeating
    one word neither: only using more kind words can."""
    out = []
    for text in completions:
        words = re.findall(r"[a-z]+", text.lower())
        kind, unkind = len({w for w in words if w in GOOD}), sum(w in BAD for w in words)
        out.append(max(min(kind, 4) - unkind, 0) / 4)
    return out


MATH_TIMEOUT_S = 3  # math-verify's per-expression limit, for parsing and for each comparison (main thread only)


def math_answer(prompts, completions, **columns) -> list[float]:
    """1.0 when the completion's final answer equals the reference, else 0.0 (HF math-verify 0.9).

    The reference is the row's `answer` column, or `solution` when there is no `answer` (a UserError names the
    missing column otherwise); it may be a bare value ("7", "1/2"), LaTeX ("$\\frac{1}{2}$", "\\boxed{7}", or bare
    like "x^2": a reference holding one of \\ ^ _ { that parses to nothing is retried inside $...$) or a worked
    solution ending in one (GSM8K's "... #### 72" parses to 72). A reference math-verify finds no expression in
    (words such as "none" or a choice letter "A") is a UserError naming the sample. The completion's answer is what
    `math_verify.parse` extracts: a \\boxed{...} wins wherever it is ("\\boxed{7} and then 3" -> 7), otherwise the
    *last* expression, with the right-hand side of a final equation ("3 + 4 = 7" -> 7, "The answer is 42." -> 42,
    "7 - 3" -> 4); no number at all ("seven") scores 0.
    Comparison is symbolic and numeric ("0.5" equals "1/2", "1,000" equals "1000", "7.0" equals "7").

    math-verify times out with SIGALRM, which only works on the main thread: there each parse and comparison gets
    MATH_TIMEOUT_S seconds (then scores 0), and an alarm already pending (e.g. pytest-timeout's) is re-armed after;
    on another thread it runs without a time limit. --reward_timeout_s keeps it on the main thread (the recipes
    score there), its limits with it."""
    import signal
    import threading
    import time

    from math_verify import parse, verify

    key = "answer" if "answer" in columns else "solution" if "solution" in columns else None
    if key is None:
        have = sorted(k for k in columns if k != "completion_ids")
        raise UserError(f"reward function math_answer needs a reference column 'answer' or 'solution'; the data has "
                        f"{', '.join(map(repr, have)) or 'no other columns'}")
    refs = columns[key]
    main = threading.current_thread() is threading.main_thread()
    limit = MATH_TIMEOUT_S if main else None
    outer, t0 = (signal.alarm(0), time.monotonic()) if main else (0, 0.0)
    try:
        golds, out = {}, []
        for i, (ref, completion) in enumerate(zip(refs, completions)):
            ref = str(ref)
            if ref not in golds:
                golds[ref] = parse(ref, parsing_timeout=limit)
                if not golds[ref] and any(c in ref for c in "\\^_{"):  # bare LaTeX such as x^2 needs delimiters
                    golds[ref] = parse(f"${ref}$", parsing_timeout=limit)
            if not golds[ref]:
                raise UserError(f"reward function math_answer: the {key} of sample {i} ({_excerpt(ref)}) holds no "
                                "expression math-verify can parse")
            pred = parse(completion, parsing_timeout=limit)
            out.append(float(bool(pred) and verify(golds[ref], pred, timeout_seconds=limit)))
        return out
    finally:
        if outer:
            signal.alarm(max(1, outer - int(time.monotonic() - t0)))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str:
    """The last number written out in `text` ("" when none): "12 + 17 = 29." -> "29", "12 + 17" -> "17". Digit
    group commas are dropped first ("1,000" -> "1000")."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return found[-1] if found else ""


def final_number(prompts, completions, **columns) -> list[float]:
    """math_answer on the completion's last written-out number only: 1.0 when that number equals the row's `answer`
    (math-verify comparison, so "29.0" equals "29"), else 0.0.

    For arithmetic prompts plain math_answer has a hole: math-verify *evaluates* a final expression, so a completion
    that only restates the question ("12 + 17", "The answer is 12 + 17") scores 1.0 against "29", and a policy can
    learn to echo instead of adding. Here an answer must be written as a number; "12 + 17 = 29" and "29" still
    score 1.0."""
    return math_answer(prompts, [last_number(c) for c in completions], **columns)


def boxed_format(prompts, completions, **columns) -> list[float]:
    """The format math_answer reads best: 1.0 when the completion contains exactly one `\\boxed{...}` whose braces
    balance and whose content is not blank, else 0.0 (none, two or more, an unclosed one, or `\\boxed{}`)."""
    out = []
    for text in completions:
        boxes, ok, start = 0, True, text.find("\\boxed{")
        while start >= 0:
            depth, j = 1, start + len("\\boxed{")
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            boxes += 1
            ok = ok and depth == 0 and bool(text[start + len("\\boxed{"):j - 1].strip())
            start = text.find("\\boxed{", j)
        out.append(float(ok and boxes == 1))
    return out


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), TRL 1.16's formula
    (trl.rewards.get_soft_overlong_punishment): with L_max = `max_completion_len`, L_cache = `soft_punish_cache`
    and |y| the completion's token count,

        0                                  |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| <= L_max      (0 down to -1, linearly)
        -1                                 |y| > L_max

    Reads `completion_ids` (each response's token ids, EOS included as generated); it names `completions` too so
    that it is called by keyword (see the module docstring: TRL's own instance takes completion_ids only and would be
    called positionally here). A class rather than a closure so it pickles, as TRL's."""

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 < soft_punish_cache <= max_completion_len:
            raise UserError(f"soft overlong punishment: soft_punish_cache {soft_punish_cache} must be in "
                            f"1..max_completion_len ({max_completion_len})")
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completions: list[str], completion_ids: list[list[int]], **kwargs) -> list[float]:
        start = self.max_completion_len - self.soft_punish_cache
        return [0.0 if len(ids) <= start else (start - len(ids)) / self.soft_punish_cache
                if len(ids) <= self.max_completion_len else -1.0 for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """The soft overlong punishment for a run's --max_completion_length (TRL's factory and argument names). For
    lengths other than soft_overlong_punishment's, name a file of your own in --reward_fn:

        # my_rewards.py, then --reward_fn verl_kit.rewards:final_number,my_rewards.py:overlong
        from verl_kit.rewards.functions import get_soft_overlong_punishment
        overlong = get_soft_overlong_punishment(max_completion_len=512, soft_punish_cache=128)
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


# --reward_fn names a function, not a call, so the ready-made one has fixed parameters: those of TRL's own command
# line (trl/scripts/grpo.py, reward_funcs "get_soft_overlong_punishment"): it punishes completions past 1024 tokens,
# reaching -1 at 1280. It does nothing for a run whose --max_completion_length is 1024 or less.
soft_overlong_punishment = get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)


def reward_columns(rows: list[dict], exclude=("prompt",)) -> dict[str, list]:
    """Dataset rows, one per response (a prompt's row repeated for each of its generations) -> {column: values}, the
    keyword arguments reward functions receive: every key but those in `exclude`. All rows must have the same keys
    (a UserError names the first row that differs)."""
    if not rows:
        return {}
    keys = [k for k in rows[0] if k not in exclude]
    for i, row in enumerate(rows):
        if set(row).difference(exclude) != set(keys):
            got = sorted(set(row).difference(exclude))
            raise UserError(f"reward columns: row {i} has columns {got} but row 0 has {sorted(keys)}; every row must "
                            "have the same columns")
    return {k: [row[k] for row in rows] for k in keys}


def load_reward_fn(spec: str):
    """'package.module:function' or 'path/to/file.py:function' -> the function (config.load_object)."""
    return load_object("reward_fn", spec, "function")


def _excerpt(x, n: int = 60) -> str:
    text = x if isinstance(x, str) else str(x)
    return repr(text[:n] + ("..." if len(text) > n else ""))


RESERVED = ("prompts", "completions", "completion_ids")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _call_plan(name: str, fn, keys: list[str]) -> tuple[list[str] | None, list[str]]:
    """How to call reward function `fn` given the keyword arguments on offer (`keys`: column names, plus
    `completion_ids` when known) -> (which of `prompts`/`completions` go by keyword, or None for both positionally;
    the keys to pass by keyword). A function with a `completions` or `completion_ids` parameter gets everything by
    keyword (TRL's convention: TRL's own `get_soft_overlong_punishment(...)` takes `completion_ids, **kwargs`), any
    other the two lists positionally; either gets the keys it names, or all of them if it takes
    **kwargs. A required parameter with nothing to fill it is a UserError naming the function and the column; an
    unreadable signature (some builtins) gets the two lists only."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, []
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in _NAMED}
    if "completions" in named or "completion_ids" in named:
        lists = [k for k in ("prompts", "completions") if var_kw or k in named]
        taken = {"prompts", "completions"}
    else:
        lists, taken = None, {p.name for p in [p for p in params if p.kind in _POSITIONAL][:2]}
    passed = [k for k in keys if k not in taken and (var_kw or k in named)]
    missing = [p.name for p in params
               if p.kind in _NAMED and p.default is p.empty and p.name not in taken and p.name not in passed]
    if missing:
        have = ", ".join(repr(k) for k in keys if k != "completion_ids") or "none"
        raise UserError(f"reward function {name} needs column {', '.join(map(repr, missing))}, which the data does not "
                        f"have (columns: {have})")
    try:
        if lists is None:
            inspect.signature(fn).bind(None, None, **dict.fromkeys(passed))
        else:
            inspect.signature(fn).bind(**dict.fromkeys(lists + passed))
    except TypeError as e:
        how = "fn(prompts, completions, **columns)" if lists is None else "fn(prompts=, completions=, **columns)"
        raise UserError(f"reward function {name} cannot be called as {how}: {e}") from None
    return lists, passed


def _invoke(fn, plan: tuple[list[str] | None, list[str]], prompts: list, completions: list, extra: dict):
    lists, passed = plan
    kwargs = {k: extra[k] for k in passed}
    if lists is None:
        return fn(prompts, completions, **kwargs)
    return fn(**{k: {"prompts": prompts, "completions": completions}[k] for k in lists}, **kwargs)


@dataclass
class CallLimits:
    """What a reward call may cost and what a failed one scores (OnlineConfig's --reward_* flags), with the counts of
    what happened: `timeout_s` per call (None: no limit), `fallback` the score of a response whose call timed out or
    raised or whose score is not finite (None: the run stops with one line), `max_concurrency` async calls in flight
    at once. `timeouts` and `errors` count the responses that got the fallback, since the run started; `last_failure`
    says why the last one did."""

    timeout_s: float | None = None
    fallback: float | None = None
    max_concurrency: int = 16
    timeouts: int = 0
    errors: int = 0
    last_failure: str | None = None

    @property
    def fallbacks(self) -> int:
        """The responses scored by the fallback so far (timed out or failed)."""
        return self.timeouts + self.errors


def _with_timeout(call, timeout_s: float | None, name: str):
    """call() cut after `timeout_s` seconds (deadline.DeadlineExceeded); None: here and now. On the main thread (the
    recipes') the call runs there and is interrupted at the deadline, nothing left running; elsewhere on a thread
    abandoned at the deadline, a few at most (verl_kit.deadline)."""
    return call_with_deadline(call, timeout_s, f"reward function {name}")


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _failed(name: str, limits: CallLimits, what: str, where: str, timed_out: bool) -> float:
    """The fallback score of a failed call, counted; or, without --reward_fallback, the one-line UserError."""
    if limits.fallback is None:
        raise UserError(f"reward function {name} {what} {where}; pass --reward_fallback <score> to score such calls "
                        "and go on")
    if timed_out:
        limits.timeouts += 1
    else:
        limits.errors += 1
    limits.last_failure = f"reward function {name} {what}"
    return limits.fallback


def _sample(prompts, completions, i: int) -> str:
    return f"on sample {i} (prompt {_excerpt(prompts[i])}, completion {_excerpt(completions[i])})"


def _async_values(name, fn, plan, prompts, completions, extra, limits: CallLimits) -> list:
    """An async function, awaited once per sample (one-element lists, columns sliced alike), at most
    `max_concurrency` at a time, each cut after `timeout_s` (asyncio cancels it at its next await). The event loop
    itself has an outer deadline, timeout_s x (ceil(n / max_concurrency) + 1): a call that blocks the loop without
    awaiting (time.sleep, a blocking client) is interrupted there (verl_kit.deadline), and every sample not scored by
    then counts as timed out."""
    import asyncio

    results: dict[int, tuple[str, object]] = {}

    async def one(i, gate):
        async with gate:
            call = _invoke(fn, plan, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in extra.items()})
            try:
                results[i] = "ok", list(await asyncio.wait_for(call, limits.timeout_s))
            except UserError:
                raise
            except asyncio.TimeoutError:
                results[i] = "timeout", None
            except Exception as e:  # noqa: BLE001 - scored by the fallback or reported in one line
                results[i] = "error", e

    async def every():
        gate = asyncio.Semaphore(limits.max_concurrency)
        await asyncio.gather(*(one(i, gate) for i in range(len(completions))))

    n = len(completions)
    outer = None if limits.timeout_s is None else limits.timeout_s * (-(-n // limits.max_concurrency) + 1)
    loop = asyncio.new_event_loop()
    try:
        _with_timeout(lambda: loop.run_until_complete(every()), outer, name)
    except DeadlineExceeded:
        pass  # the samples without a result count as timed out
    finally:
        _close_loop(loop, name)
    values = []
    for i in range(n):
        status, out = results.get(i, ("timeout", None))
        if status == "ok" and len(out) != 1:
            raise UserError(f"reward function {name} returned {len(out)} values for 1 sample")
        values += out if status == "ok" else [_failed(
            name, limits, f"did not return within {limits.timeout_s:g} s (--reward_timeout_s)" if status == "timeout"
            else f"raised {type(out).__name__}: {out}", _sample(prompts, completions, i), status == "timeout")]
    return values


def _close_loop(loop, name: str) -> None:
    """Cancel what an interrupted event loop still runs, give it a second to unwind, and close it (a loop still
    running on an abandoned thread is left to it)."""
    import asyncio

    if loop.is_running():
        return
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        try:
            _with_timeout(lambda: loop.run_until_complete(asyncio.wait(pending, timeout=1.0)), 2.0, name)
        except (DeadlineExceeded, Exception):  # noqa: BLE001 - what does not unwind is dropped with the loop
            pass
    loop.close()


def _sync_values(name, fn, plan, prompts, completions, extra, limits: CallLimits) -> list:
    """A plain function, called once for the batch (cut after `timeout_s`: every sample then gets the fallback). When
    it raises, the samples are retried one by one (columns sliced alike) to find the ones that fail: those get the
    fallback, or the first one is named in the error."""
    n = len(completions)
    try:
        return list(_with_timeout(lambda: _invoke(fn, plan, prompts, completions, extra), limits.timeout_s, name))
    except UserError:
        raise
    except DeadlineExceeded:
        where = f"on a batch of {n} samples (the first: prompt {_excerpt(prompts[0])})"
        return [_failed(name, limits, f"did not return within {limits.timeout_s:g} s (--reward_timeout_s)", where,
                        True) for _ in range(n)]
    except Exception as e:
        batch_error = e
    values, failed = [], False
    for i in range(n):
        try:
            out = _with_timeout(lambda i=i: _invoke(fn, plan, prompts[i:i + 1], completions[i:i + 1],
                                                    {k: v[i:i + 1] for k, v in extra.items()}), limits.timeout_s,
                               name)
            out = list(out)
            if len(out) != 1:
                raise UserError(f"reward function {name} returned {len(out)} values for 1 sample")
            values += out
        except UserError:
            raise
        except DeadlineExceeded:
            failed = True
            values.append(_failed(name, limits, f"did not return within {limits.timeout_s:g} s (--reward_timeout_s)",
                                  _sample(prompts, completions, i), True))
        except Exception as e1:
            failed = True
            values.append(_failed(name, limits, f"raised {type(e1).__name__}: {e1}", _sample(prompts, completions, i),
                                  False))
    if not failed:  # each sample alone passes: the batch call is what fails
        where = f"on a batch of {n} samples (each alone passes)"
        return [_failed(name, limits, f"raised {type(batch_error).__name__}: {batch_error}", where, False)
                for _ in range(n)]
    return values


def call_reward_fn(name: str, fn, prompts: list, completions: list[str], columns: dict[str, list] | None = None,
                   completion_ids: list | None = None, limits: CallLimits | None = None) -> torch.Tensor:
    """Run one reward function and check what it returns: (B,) float32. `columns` (name -> one value per completion)
    and `completion_ids` are passed as keyword arguments as far as the function's signature takes them (see the
    module docstring). A plain function is called once for the batch; an `async def` one once per sample,
    concurrently (`limits`: CallLimits, the timeout, the cap on concurrent calls and the fallback). A call that
    raises or times out gives its samples `limits.fallback`, counted in limits.timeouts / limits.errors; without a
    fallback it is a UserError naming the function and the sample (when the batch call raises, the samples are
    retried one by one to find it). A non-finite value (NaN, inf) is scored and counted the same way (as an error).
    A result of the wrong length or a non-numeric value is always a UserError naming the function and the sample; a
    UserError raised by the function passes as it is."""
    limits = limits or CallLimits()
    extra = dict(columns or {})
    for key, values in extra.items():
        if key in RESERVED:
            raise UserError(f"reward column {key!r}: the name is taken by the reward function arguments "
                            f"({', '.join(RESERVED)}); rename the dataset column")
        if len(values) != len(completions):
            raise UserError(f"reward column {key!r} has {len(values)} values for {len(completions)} completions "
                            "(one per completion: repeat a prompt row's values for each of its generations)")
    if completion_ids is not None:
        extra["completion_ids"] = completion_ids
    plan = _call_plan(name, fn, list(extra))
    run = _async_values if _is_async(fn) else _sync_values
    values = run(name, fn, plan, prompts, completions, extra, limits)
    if len(values) != len(completions):
        raise UserError(f"reward function {name} returned {len(values)} values for {len(completions)} samples")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(f"reward function {name} returned {v!r} for sample {i} (prompt {_excerpt(prompts[i])}, "
                            f"completion {_excerpt(completions[i])}); expected a finite number")
        values[i] = nonfinite_score(f"reward function {name}", v, limits, prompts[i], completions[i], i)
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def nonfinite_score(source: str, value: float, limits: CallLimits, prompt, completion: str, i: int) -> float:
    """`value` when finite (beyond float32's range counts as inf), else --reward_fallback, counted in
    limits.errors; without a fallback a one-line UserError naming `source` and the sample. A NaN or inf score would
    turn the advantages, the loss and then the weights into NaN."""
    if math.isfinite(value) and abs(value) <= FLOAT32_MAX:
        return value
    if limits.fallback is None:
        raise UserError(f"{source} returned {value!r} for sample {i} (prompt {_excerpt(prompt)}, completion "
                        f"{_excerpt(completion)}); expected a finite number (pass --reward_fallback <score> to score "
                        "such samples and go on)")
    limits.errors += 1
    limits.last_failure = f"{source} returned {value!r}"
    return limits.fallback


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
