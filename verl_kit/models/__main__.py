"""Build the embedded model, its data or the packaged real model from the command line:

    python -m verl_kit.models tiny OUT_DIR       # the embedded tiny model and tokenizer (models.tiny.build_tiny_model)
    python -m verl_kit.models tiny-data          # rewrite verl_kit/assets/tiny_prefs (models.tiny)
    python -m verl_kit.models smollm2 OUT_DIR    # dequantize the packaged SmolLM2 GGUF (models.real_model)

`models.loading.resolve_model_path` runs the first and the last in a child process on first use. They live in this
entry module rather than under `if __name__ == "__main__"` in models.tiny and models.real_model because the package's
`__init__` imports those two: `python -m` on them would execute a second copy of a module already imported (runpy's
"found in sys.modules" RuntimeWarning).
"""

from __future__ import annotations

import argparse
import sys

from verl_kit.errors import UserError
from verl_kit.models.real_model import convert_smollm2
from verl_kit.models.tiny import TINY_PREFS, build_tiny_model, write_preference_data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_kit.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("tiny", help="build the embedded tiny model into OUT_DIR").add_argument("out_dir")
    sub.add_parser("tiny-data", help=f"rewrite {TINY_PREFS}/train.jsonl and test.jsonl")
    sub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct into OUT_DIR").add_argument("out_dir")
    args = parser.parse_args(argv)
    try:
        if args.what == "tiny":
            print(build_tiny_model(args.out_dir))
        elif args.what == "tiny-data":
            write_preference_data()
            print(f"wrote {TINY_PREFS}/train.jsonl and test.jsonl")
        else:
            print(convert_smollm2(args.out_dir))
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
