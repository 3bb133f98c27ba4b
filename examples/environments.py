"""Example environments for multi-turn GRPO (docs/environments.md), in TRL's environment API: copy one and edit it.

    python recipes/grpo.py --environment_factory examples/environments.py:KindFeedback      # the tiny model
    python recipes/grpo.py --tools examples/environments.py:calculate ...                  # a plain tool function
    # the real model on three-digit products (verl_kit/assets/calc): warm-start traces, SFT, then GRPO
    python examples/environments.py traces --model smollm2-135m --out data/calc_traces
    python recipes/sft.py --config recipes/configs/sft_calc.yaml
    python recipes/grpo.py --config recipes/configs/grpo_calc.yaml

KindFeedback (the `respond` path, beyond TRL): the embedded tiny task (a kind reply) with a checker that answers
the model's reply as the user until it is kind or two tries are spent; get_reward() scores the last reply.
Calculator (a tool): `calculate(expression)` evaluates + - * / on numbers; get_reward() is 1 when the final reply's
last number is the row's `answer`.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re

KIND = {"lovely", "bright", "warm", "kind", "calm", "gentle", "wonderful", "charming", "cheerful", "delightful",
        "graceful", "friendly", "pleasant", "brilliant", "peaceful", "splendid"}  # the tiny task's kind words


class KindFeedback:
    """Asks again, as the user, until the reply has a kind word (at most two follow-ups)."""

    def reset(self, **row) -> str | None:
        self.tries, self.last = 0, ""
        return None  # nothing added to the prompt

    def respond(self, text: str) -> str | None:
        self.last, self.tries = text, self.tries + 1
        if self._kind_words(text) or self.tries > 2:
            return None  # the episode ends
        return "Please say it more kindly."

    def _kind_words(self, text: str) -> int:
        return len(KIND & set(re.findall(r"[a-z]+", text.lower())))

    def get_reward(self) -> float:
        return min(self._kind_words(self.last), 4) / 4 - 0.1 * max(self.tries - 1, 0)  # tries 0: cut before a reply


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "123 * 45 + 6"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


class Calculator:
    """One tool, `calculate`; the reward checks the final answer against the row's `answer` column."""

    def reset(self, answer: str = "", **row) -> None:
        self.answer, self.replies = str(answer), 0

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses.

        Args:
            expression: the expression, e.g. "123 * 45 + 6"
        """
        return calculate(expression)

    def respond(self, text: str) -> None:
        self.final = text  # the assistant's last message (no tool call in it): the episode ends
        return None

    def get_reward(self) -> float:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", getattr(self, "final", ""))
        return float(bool(numbers) and numbers[-1] == self.answer)


# ---- warm-start traces: a model that never calls the tool learns the format from a few hundred SFT examples -------
def calculator_traces(rows: list[dict], model: str) -> list[dict]:
    """One SFT `messages` row per dataset row: the question, a well-formed `calculate` call of its expression, the
    tool's result and the answer, rendered as an episode renders them (Episodes.trace: the tools in the system
    message for a template without tool support, the result inserted as the loop inserts it)."""
    from verl_kit.models.loading import load_tokenizer, resolve_model_path
    from verl_kit.rollout.episodes import Episodes

    episodes = Episodes(None, load_tokenizer(resolve_model_path(model)), model, Calculator)
    out = []
    for i, row in enumerate(rows, 1):
        expression = re.search(r"What is (.+?)\?", row["prompt"][-1]["content"]).group(1)
        call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
        out.append({"messages": episodes.trace(row, [f"<tool_call>{call}</tool_call>", row["answer"]], i)})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="write warm-start traces (SFT messages rows) for the Calculator")
    parser.add_argument("task", choices=["traces"])
    parser.add_argument("--model", default="smollm2-135m", help="the model whose chat template renders them")
    parser.add_argument("--data", default=None, help="task directory (default: the shipped verl_kit/assets/calc)")
    parser.add_argument("--out", required=True, help="output directory for train.jsonl and test.jsonl")
    parser.add_argument("--n_train", type=int, default=400)
    parser.add_argument("--n_test", type=int, default=32)
    args = parser.parse_args(argv)
    from verl_kit.data.tasks import CALC, write_jsonl

    data = args.data or CALC
    os.makedirs(args.out, exist_ok=True)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        with open(os.path.join(data, f"{split}.jsonl")) as f:
            rows = [json.loads(line) for line, _ in zip(f, range(n))]
        write_jsonl(os.path.join(args.out, f"{split}.jsonl"), calculator_traces(rows, args.model))
    print(f"wrote {args.n_train} train and {args.n_test} test traces to {args.out}")


if __name__ == "__main__":
    main()
