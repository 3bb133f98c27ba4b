"""Example agents for `--agent` (docs/agents.md), written only against the `openai` package: copy one and edit it.

    python recipes/grpo.py --agent examples/agents.py:calculator --config recipes/configs/grpo_calc.yaml \
        --environment_factory none --reward_fn none

An agent is a function `fn(client, row)`, plain or async: `client` is an `openai.OpenAI` (an `openai.AsyncOpenAI` for
an async function) whose base URL and key are the run's endpoint for this episode (`client.base_url`,
`client.api_key`, for frameworks that want those), `row` the dataset row. It runs any loop it likes against
`client.chat.completions.create` (the `model` it names is ignored: the policy answers) and returns the episode's
reward, or None to leave the scoring to `--reward_fn`.

`calculator` is the calculator task of docs/environments.md (examples/environments.py:Calculator) as an agent: the
`calculate` tool offered through function calling, the tool run by the agent itself, the answer checked against the
row's `answer` column. Its tool schema is the one the environment's method gets, so the policy sees the same prompt.
"""

from __future__ import annotations

import json
import os
import re
import sys

from openai import AsyncOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from environments import calculate  # noqa: E402 - the environment example's tool, unchanged

CALCULATE = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the expression, e.g. \"123 * 45 + 6\""}}, "required": ["expression"]},
    "return": {"type": "string"}}}


async def calculator(client: AsyncOpenAI, row: dict) -> float:
    """Ask; run the tool calls the reply makes and ask again (two rounds at most); 1.0 when the final reply's last
    number is the answer."""
    messages = list(row["prompt"])
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply as served: the history stays exact
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001 - the model sees the error, as the environment's tools do
                result = str({"error": str(e) or type(e).__name__})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", message.content or "")
    return float(bool(numbers) and numbers[-1] == str(row["answer"]))
