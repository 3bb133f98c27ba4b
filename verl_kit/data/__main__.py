"""Write the embedded datasets from the command line:

    python -m verl_kit.data arith [--out DIR --lo 1 --hi 30 --ops + ...]   # the arithmetic task (data.tasks)
    python -m verl_kit.data calc [--out DIR ...]                            # the calculator task (data.tasks)
    python -m verl_kit.data sft                                             # the SFT task (data.sft)

An entry module of its own because the package's `__init__` imports data.tasks and data.sft: `python -m` on those
would execute a second copy of a module already imported (runpy's "found in sys.modules" RuntimeWarning).
"""

from __future__ import annotations

import sys

from verl_kit.data.sft import TINY_SFT, write_sft_data
from verl_kit.data.tasks import main as write_task


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sft"]:
        write_sft_data()
        print(f"wrote {TINY_SFT}/train.jsonl and test.jsonl")
    else:
        write_task(argv)


if __name__ == "__main__":
    main()
