"""Model output cannot crash a run through the tool parser or an environment (issue 39, item 7): JSON nested past the
parser's recursion, an integer of 5,000 digits, a call without `arguments` or whose `name` is not a string, a tool
that exits, and an environment whose `respond` or `get_reward` raises each end that tool call (an error result the
model sees, counted in tools/failure_frequency) or that episode (counted in episode/env_errors), never the run."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import Scripted, add

from verl_kit.rewards import CallLimits, Rewards
from verl_kit.rollout import SamplingParams
from verl_kit.rollout.episodes import Episodes
from verl_kit.rollout.prompts import episode_metrics
from verl_kit.rollout.tools import call_tool, parse_tool_calls

NESTED = "[" * 1500 + "]" * 1500
HUGE = "9" * 5000



def leave() -> str:
    """A tool that exits the interpreter."""
    raise SystemExit(3)


@pytest.mark.parametrize("body, says", [
    (f'{{"name": "add", "arguments": {NESTED}}}', "malformed tool call (nested too deeply)"),
    (f'{{"name": "add", "arguments": {{"a": {HUGE}, "b": 1}}}}', "malformed tool call (not JSON: Exceeds the limit"),
    ('{"name": ["add"], "arguments": {}}', "malformed tool call (expected"),
    ('{"name": 7}', "malformed tool call (expected"),
    ('[1, 2]', "malformed tool call (expected"),
    ('{"name": add', "malformed tool call (not JSON: Expecting value)"),
])
def test_model_text_the_parser_cannot_read_is_an_error_result(body, says):
    """Each call is an error string (the tool's result the model sees), never an exception."""
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, str) and call.startswith(says), call
    name, result, failed = call_tool({"add": add}, call, 1.0)
    assert failed and result.startswith("{'error': 'malformed tool call")


def test_calls_from_any_parser_are_normalised():
    """A call without `arguments` gets {} (and runs, or fails as a call of the tool), arguments given as a JSON string
    are parsed (as a string nested too deeply they stay a string: {"value": ...}); a dict that reaches call_tool
    straight from a tokenizer's parser without `arguments` or with a list as `name` is read the same way."""
    calls = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>'
                             f'<tool_call>{{"name": "add", "arguments": {json.dumps(NESTED)}}}</tool_call>')
    assert calls == [{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 2, "b": 3}},
                     {"name": "add", "arguments": {"value": NESTED}}]
    assert call_tool({"add": add}, calls[1], 1.0) == ("add", "5", False)
    name, result, failed = call_tool({"add": add}, {"name": "add"}, 1.0)
    assert failed and "missing 2 required positional arguments" in result
    name, result, failed = call_tool({"add": add}, {"name": ["add"], "arguments": {}}, 1.0)
    assert failed and "malformed tool call" in result
    name, result, failed = call_tool({"leave": leave}, {"name": "leave", "arguments": {}}, 1.0)
    assert failed and result == "{'error': '3'}"


class Fragile:
    """An environment that fails on what the model writes: its tool and respond raise on a nested answer, get_reward
    raises when the reply was not a number."""

    def reset(self, **row):
        self.reply = ""

    def check(self, answer: str) -> str:
        """Check an answer.

        Args:
            answer: the answer
        """
        return str(json.loads(answer))

    def respond(self, text: str) -> str | None:
        self.reply = text
        return str(json.loads(text))  # raises on text that is not JSON

    def get_reward(self) -> float:
        return float(int(self.reply))  # raises on a reply that is not an integer


ROW = {"prompt": [{"role": "user", "content": "Answer."}]}


def test_environment_methods_that_raise_end_the_episode_counted(tokenizer):
    """Turn 1 calls `check` with a 5,000-digit answer (its json.loads raises ValueError: an error result, the episode
    goes on); turn 2 is text `respond` cannot parse (the episode ends there); get_reward then raises too. The episode
    counts 2 environment errors and 1 failed tool call; its environment score is 0, or --reward_fallback (counted)."""
    call = json.dumps({"name": "check", "arguments": {"answer": HUGE}})
    eps = Episodes(Scripted(tokenizer, [f"<tool_call>{call}</tool_call>", "not json"]), tokenizer, "tiny-llama",
                   env_factory=Fragile, max_prompt_length=512, max_completion_length=20000)
    ro = eps.run([ROW], [1], SamplingParams())
    ep = ro.episodes[0]
    assert (ep["turns"], ep["tool_calls"], ep["tool_failures"], ep["env_errors"]) == (2, 1, 1, 2)
    assert "Exceeds the limit" in ep["messages"][-2]["content"] and ep["messages"][-1]["content"] == "not json"
    assert ep["reward_error"].startswith("Fragile.get_reward raised ValueError: invalid literal for int()")
    assert episode_metrics(ro, torch.zeros(1))["episode/env_errors"] == 2.0
    ro = replace(ro, rows=[ROW])  # the dataset row it was played from
    assert Rewards("none", None, None, tokenizer=tokenizer, env_reward=True).of_rollout(ro).total.tolist() == [0.0]
    rewards = Rewards("none", None, None, tokenizer=tokenizer, env_reward=True, limits=CallLimits(fallback=-1.0))
    assert rewards.of_rollout(ro).total.tolist() == [-1.0] and rewards.limits.errors == 1
