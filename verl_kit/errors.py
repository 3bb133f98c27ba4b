"""User-facing errors: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A mistake in the user's input (flag, config, data row, path). The message names what is wrong and where."""


def main_guard(fn):
    """Decorate a recipe's main(): a UserError prints `error: <message>` and exits 2; an out-of-memory error that no
    step redid (train/out_of_memory.py redoes those inside an optimizer step's micro-batches) prints one line naming
    where it struck and exits 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        except (RuntimeError, MemoryError, OSError) as e:
            from verl_kit.train.out_of_memory import is_out_of_memory, reason

            if not is_out_of_memory(e):
                raise
            print(f"error: out of memory{_where(e)} ({reason(e)}), outside the micro-batches a step can redo: the "
                  "run stops, the last checkpoint is intact; the memory plan's table at start and docs/memory.md "
                  "say which flags shrink what", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapper


def _where(e: BaseException) -> str:
    """` in <folder>/<file>:<line>` of the innermost frame of the kit or a recipe in `e`'s traceback, or ''."""
    import traceback

    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if ("verl_kit" in f.filename or "recipes" in f.filename) and f.filename != __file__]
    if not ours:
        return ""
    return f" in {'/'.join(ours[-1].filename.split('/')[-2:])}:{ours[-1].lineno}"
