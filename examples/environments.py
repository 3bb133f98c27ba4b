"""Example environments for multi-turn GRPO (docs/environments.md), in TRL's environment API: copy one and edit it.

    python recipes/grpo.py --environment_factory examples/environments.py:KindFeedback      # the tiny model
    python -m verl_kit.data.tasks arith --lo 100 --hi 999 --ops '*' --out data/arith_tool \\
        --instruction "Use the calculate tool if it helps, then reply with only the number."
    python recipes/grpo.py --model_name_or_path smollm2-135m --dataset_name data/arith_tool \\
        --environment_factory examples/environments.py:Calculator --reward_fn none ...      # the real model
    python recipes/grpo.py --tools examples/environments.py:calculate ...                  # a plain tool function

KindFeedback (the `respond` path, beyond TRL): the embedded tiny task (a kind reply) with a checker that answers
the model's reply as the user until it is kind or two tries are spent; get_reward() scores the last reply.
Calculator (a tool): `calculate(expression)` evaluates + - * / on numbers; get_reward() is 1 when the final reply's
last number is the row's `answer`.
"""

from __future__ import annotations

import ast
import operator
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
        return min(self._kind_words(self.last), 4) / 4 - 0.1 * (self.tries - 1)


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
