"""Tools and environments for multi-turn episodes (rollout.episodes), in TRL's API: `--environment_factory
module.py:Class` (one instance per episode: `reset(**row)`, public methods are its tools, optional `get_reward()` and,
beyond TRL, `respond(text)`), `--tools module.py:fn,...` (plain functions). A tool's JSON schema comes from its name,
type hints and docstring (transformers' `get_json_schema`). Tool calls are read from the model's text: the
tokenizer's own parser where it has one (transformers' `parse_response`, a template with a response schema), else
Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format Qwen's templates and the
fallback system prompt (`describe_tools`, for templates without tool support) use."""

from __future__ import annotations

import asyncio
import inspect
import json
import re

from verl_kit.deadline import DeadlineExceeded, call_with_deadline
from verl_kit.errors import UserError


def environment_tools(env) -> dict:
    """An environment instance's tools: its public methods other than reset, get_reward and respond (TRL lists them
    on the class, so properties are not evaluated)."""
    skip = {"reset", "get_reward", "respond"}
    return {n: getattr(env, n) for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not n.startswith("_") and n not in skip}


def tool_schema(fn) -> dict:
    """transformers' JSON schema of a tool (name, description and parameters from its signature and docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for an undocumented tool
        raise UserError(f"tool {getattr(fn, '__qualname__', fn)!r}: no JSON schema ({e}); give it type hints and a "
                        "Google-style docstring with an Args: section") from None


def supports_tools(tokenizer) -> bool:
    """The chat template renders a whole tool-calling exchange (TRL's check: user -> assistant with tool_calls ->
    tool, every part visible); else the fallback system prompt describes the tools and results come back as user
    messages."""
    from trl.chat_template_utils import supports_tool_calling

    return supports_tool_calling(tokenizer)


FALLBACK_HEADER = ("You may call these tools. To call one, write <tool_call>{\"name\": <tool name>, \"arguments\": "
                   "<arguments as a JSON object>}</tool_call>; its result comes back in "
                   "<tool_response></tool_response>.")


def describe_tools(schemas: list[dict]) -> str:
    """The fallback system prompt for templates without tool support (Hermes-style, as Qwen2.5's template writes)."""
    return FALLBACK_HEADER + "\n<tools>\n" + "\n".join(json.dumps(s) for s in schemas) + "\n</tools>"


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MALFORMED = "malformed tool call (expected {\"name\": ..., \"arguments\": {...}})"


def _json(text: str):
    """json.loads, or the one-line reason the model's text is not JSON the kit reads: a syntax error, an integer of
    more digits than Python converts (ValueError), or nesting deeper than the parser's recursion (RecursionError).
    Model output must never raise out of the parser."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as e:
        return None, f"not JSON: {str(e).splitlines()[0]}"


def as_call(call) -> dict | str:
    """A parsed call, from either parser, as {"name": str, "arguments": dict}, or the error string the model sees: a
    call that is not an object, or whose `name` is not a string, is malformed; missing `arguments` are {}; arguments
    given as a JSON string are parsed; any other value x becomes {"value": x}."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MALFORMED
    args = call.get("arguments")
    if args is None:
        args = {}
    if isinstance(args, str):
        parsed, error = _json(args)
        if error is None:
            args = parsed
    return {"name": call["name"], "arguments": args if isinstance(args, dict) else {"value": args}}


def parse_tool_calls(text: str, tokenizer=None) -> list[dict | str]:
    """The tool calls in an assistant message: dicts {"name", "arguments"}, or an error string for a call that does not
    parse (the model then sees it as the tool's result). The tokenizer's parser first (transformers' parse_response,
    when the tokenizer has a response schema), else Hermes `<tool_call>` blocks. Nothing the model writes raises."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        try:
            calls = tokenizer.parse_response(text).get("tool_calls") or []
            return [as_call(c.get("function", c) if isinstance(c, dict) else c) for c in calls]
        except Exception:  # noqa: BLE001 - fall back to the Hermes reader below (RecursionError included)
            pass
    out: list[dict | str] = []
    for body in TOOL_CALL.findall(text):
        call, error = _json(body)
        out.append(f"malformed tool call ({error})" if error else as_call(call))
    return out


def call_tool(tools: dict, call: dict | str, timeout_s: float | None) -> tuple[str, str, bool]:
    """Run one parsed tool call: (tool name, result text, failed). A malformed call, an unknown tool, a tool that
    raises or runs past `timeout_s` gives TRL's `{"error": ...}` as the result, and failed=True. The call is cut at
    `timeout_s` by verl_kit.deadline: interrupted where it is on the main thread, abandoned on its thread elsewhere
    (a few at most, then the run stops in one line); an async tool also runs under asyncio.wait_for."""
    call = as_call(call) if isinstance(call, dict) else call
    if isinstance(call, str):
        return "unknown", str({"error": call}), True
    name, args = call["name"], call["arguments"]
    fn = tools.get(name)
    if fn is None:
        return name, str({"error": f"Tool {name} not found."}), True

    def run():
        result = fn(**args)
        if inspect.isawaitable(result):
            result = asyncio.run(asyncio.wait_for(result, timeout_s) if timeout_s else result)
        return str(result)

    try:
        return name, call_with_deadline(run, timeout_s, f"tool {name}"), False
    except (DeadlineExceeded, asyncio.TimeoutError, TimeoutError):
        return name, str({"error": f"Tool {name} timed out after {timeout_s:g} s"}), True
    except UserError:  # the cap on abandoned calls (verl_kit.deadline)
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the model sees it, the run goes on
        return name, str({"error": str(e) or type(e).__name__}), True
