"""The agent endpoint (verl_kit.rollout.endpoint) as agent frameworks use it, unchanged: the openai package (chat
completions and the Responses API, plain and streaming), the openai-agents SDK (its default model, which speaks the
Responses API; its chat-completions model; a streamed run) and LangChain's ChatOpenAI with bind_tools, each written
as its users write it (tests/rollout/framework_agents.py). Every way is served and every token the policy sampled is
recorded once, whichever API and mode; the replies and stream events parse as the openai package's own types; what
the endpoint does not serve is a 400 in OpenAI's shape; and recipes/grpo.py trains on all of them."""

import json

import pytest
from helpers import eos_biased_engine, metrics, recipe_cmd, run
from pydantic import TypeAdapter
from test_agents import ROW, split_of

from verl_kit.rollout import AgentEpisodes, SamplingParams
from verl_kit.rollout.endpoint import (
    ChatRequest,
    EndpointError,
    ResponsesRequest,
    chat_body_of_response,
    chat_chunks,
    check_chat,
    response_events,
    response_of_completion,
)

AGENT = "tests/rollout/framework_agents.py:agent"


@pytest.fixture(scope="module")
def eos_engine(tiny_model_path, tokenizer):
    """HF generate on the tiny model, its EOS logit raised so that turns end (as test_agents')."""
    return eos_biased_engine(tiny_model_path, tokenizer)


def test_every_framework_is_served_and_each_sampled_token_recorded_once(eos_engine, tokenizer, tmp_path,
                                                                       monkeypatch):
    """One episode per way on HF generate: none fails, and for the ways whose replies report usage (the openai
    package's four) the tokens the trainer gets as sampled equal, episode by episode, the completion tokens the
    replies reported (a call that extends the previous one merges into its row; tool_choice "required" writes the
    start of a call into the prompt, not into the sampled tokens)."""
    import framework_agents

    log = tmp_path / "ways.jsonl"
    monkeypatch.setenv("FRAMEWORK_LOG", str(log))
    rows = [{**ROW, "way": i} for i in range(len(framework_agents.WAYS))]
    eps = AgentEpisodes(eos_engine, tokenizer, "tiny-llama", framework_agents.agent, max_concurrency=8,
                        timeout_s=120, max_prompt_length=768, max_completion_length=32)
    try:
        ro = eps.generate(split_of(rows, tokenizer), list(range(len(rows))), SamplingParams(max_new_tokens=32))
    finally:
        eps.close()
    assert [e["reward_error"] for e in ro.episodes] == [None] * len(ro.episodes), ro.episodes
    lines = {json.loads(x)["way"]: json.loads(x) for x in log.read_text().splitlines()}
    assert sorted(lines) == sorted(w.__name__ for w in framework_agents.WAYS)
    sampled = ro.response_mask.sum(-1).tolist()  # the sampled tokens of each row (inserted ones: env_mask)
    episode = ro.episode or list(range(len(sampled)))  # each row's episode
    counted = 0
    for i, way in enumerate(framework_agents.WAYS):
        if lines[way.__name__]["tokens"] is not None:
            mine = sum(n for n, e in zip(sampled, episode) if e == i)
            assert mine == lines[way.__name__]["tokens"] > 0, (way.__name__, mine, lines[way.__name__])
            counted += 1
    assert counted == 4


COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny-llama",
              "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                  "role": "assistant", "content": "Let me multiply.", "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]}}],
              "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}


def test_replies_and_stream_events_parse_as_the_openai_types():
    """A chat.completion with text and a tool call, as the Responses API's response and as both streams: each object
    validates as the openai package's own model (ChatCompletionChunk, Response, ResponseStreamEvent)."""
    from openai.types.chat import ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    chunks = chat_chunks(COMPLETION, include_usage=True)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[1].choices[0].delta.content == "Let me multiply."
    assert parsed[2].choices[0].delta.tool_calls[0].function.name == "multiply"
    assert parsed[-2].choices[0].finish_reason == "tool_calls" and parsed[-1].usage.completion_tokens == 9
    body = {"input": "6 x 7?", "tools": [{"type": "function", "name": "multiply", "parameters": {}}]}
    request = ResponsesRequest.model_validate(body)
    response = Response.model_validate(response_of_completion("resp_1", request, body, COMPLETION, 1))
    assert response.output_text == "Let me multiply." and response.output[1].call_id == "call_1"
    assert response.usage.output_tokens == 9
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e)
              for e in response_events(response_of_completion("resp_1", request, body, COMPLETION, 1))]
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.done" in [e.type for e in events]


def test_input_items_become_the_chat_the_policy_sees():
    """Responses input items (a message, a function call and its output) and instructions, after the conversation of
    a previous response: the chat messages and tools the rollout thread renders."""
    body = {"input": [{"type": "function_call", "call_id": "c1", "name": "multiply", "arguments": '{"a": 6}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "42"},
                      {"role": "user", "content": [{"type": "input_text", "text": "So?"}]}],
            "instructions": "Be brief.", "tools": [{"type": "function", "name": "multiply", "parameters": {}}],
            "tool_choice": {"type": "function", "name": "multiply"}, "max_output_tokens": 5}
    chat, conversation = chat_body_of_response(ResponsesRequest.model_validate(body), body,
                                               [{"role": "user", "content": "6 x 7?"}])
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 x 7?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "So?"}]
    assert conversation == chat["messages"][1:] and chat["max_tokens"] == 5
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "multiply"}}
    assert chat["tools"][0]["function"]["name"] == "multiply"


@pytest.mark.parametrize("model, body, param", [
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "stop"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format.type"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, "audio"),
    (ChatRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (ResponsesRequest, {"input": "x", "include": ["file_search_call.results"]}, "include"),
    (ResponsesRequest, {"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    (ResponsesRequest, {"input": "x", "background": True}, "background"),
])
def test_what_the_endpoint_does_not_serve_is_a_400(model, body, param):
    """Never a silent drop: each unsupported field or value is refused in OpenAI's error shape, naming it."""
    from verl_kit.rollout.endpoint import _validated

    with pytest.raises(EndpointError) as e:
        check_chat(body) if model is ChatRequest else _validated(model, body)
    error = e.value.payload()["error"]
    assert e.value.status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.slow
def test_grpo_trains_on_every_framework(tmp_path):
    """recipes/grpo.py with the eight-way agent, 2 steps on the tiny model (HF generate): every episode of both
    steps served (no env error), all eight ways ran, the policy was updated on their tokens."""
    log = tmp_path / "ways.jsonl"
    out = tmp_path / "run"
    run(recipe_cmd("grpo.py", ["--config", "recipes/configs/grpo_tiny.yaml", "--output_dir", str(out),
                               "--max_steps", "2", "--prompts_per_step", "4", "--num_generations", "2",
                               "--max_completion_length", "16", "--max_prompt_length", "768", "--max_length", "1000",
                               "--dataset_test_split", "none", "--logging_steps", "1", "--agent", AGENT]),
        timeout=420, FRAMEWORK_LOG=str(log))
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["episode/env_errors"] == 0 for r in rows), rows
    assert all(r["response_length/mean"] > 0 and r["grad_norm"] > 0 for r in rows), rows
    ways = [json.loads(x)["way"] for x in log.read_text().splitlines()]
    assert len(ways) == 16 and len(set(ways)) == 8, ways
