"""User-facing errors: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A mistake in the user's input (flag, config, data row, path). The message names what is wrong and where."""


def main_guard(fn):
    """Decorate a recipe's main(): a UserError prints `error: <message>` and exits 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
