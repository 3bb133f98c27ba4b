"""One `--agent` written eight ways, against the run's endpoint, as each framework's user writes it (the tests of
tests/rollout/test_agent_frameworks.py): the openai package (chat completions, plain and streaming; the Responses
API, with previous_response_id and function-call items, plain and streaming), the openai-agents SDK (its default model,
which speaks the Responses API; its chat-completions model; a streamed run) and LangChain's ChatOpenAI with
bind_tools (invoke and stream). Episodes take the ways in turn; each appends a line to $FRAMEWORK_LOG when it ends
without an error. The task: multiply two numbers with a function tool; the reward: the product in the answer."""

import itertools
import json
import os

from agents import (
    Agent,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # nothing leaves the machine
QUESTION = "What is 6 times 7? Use the multiply tool."
CHAT_TOOL = {"type": "function", "function": {"name": "multiply", "description": "a times b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
_turn = itertools.count()


@function_tool
def multiply(a: float, b: float) -> float:
    """a times b"""
    return a * b


def _score(text) -> float:
    """1 for the product in the answer, else a little for brevity: a random policy's groups are not flat, so the
    tests' short runs have a gradient."""
    text = str(text or "")
    return 1.0 if "42" in text else 1 / (1 + len(text))


async def chat_plain(client):
    messages = [{"role": "user", "content": QUESTION}]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CHAT_TOOL])
    message, tokens = reply.choices[0].message, reply.usage.completion_tokens
    if message.tool_calls:  # the policy called the tool: send the results back
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args.get("a", 0) * args.get("b", 0))})
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CHAT_TOOL])
        message, tokens = reply.choices[0].message, tokens + reply.usage.completion_tokens
    return _score(message.content), tokens


async def chat_stream(client):
    text, usage, finish = "", None, None
    stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": QUESTION}],
                                                  tools=[CHAT_TOOL], tool_choice="required", stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens > 0 and finish is not None, (usage, finish)
    return _score(text), usage.completion_tokens


async def responses_plain(client):
    first = await client.responses.create(model="policy", input=QUESTION, tools=[RESPONSES_TOOL],
                                          instructions="You are a calculator.")
    # the agent then hands a tool result back, within the episode (as if the policy had called the tool)
    follow = await client.responses.create(
        model="policy", previous_response_id=first.id, tools=[RESPONSES_TOOL],
        input=[{"type": "function_call", "call_id": "call_1", "name": "multiply", "arguments": '{"a": 6, "b": 7}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "42"},
               {"role": "user", "content": "So?"}])
    assert follow.previous_response_id == first.id and follow.output, follow
    return _score(follow.output_text), first.usage.output_tokens + follow.usage.output_tokens


async def responses_stream(client):
    kinds, text, final = [], "", None
    stream = await client.responses.create(model="policy", input=QUESTION, tools=[RESPONSES_TOOL], stream=True)
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and final is not None, kinds
    return _score(text), final.usage.output_tokens


def _agent():
    return Agent(name="calculator", instructions="Answer with the product.", tools=[multiply], model="policy")


async def agents_default(client):  # Agent + Runner.run: the SDK's default model speaks the Responses API
    try:
        result = await Runner.run(_agent(), QUESTION, run_config=RunConfig(model_provider=OpenAIProvider(
            openai_client=client)), max_turns=3)
    except ModelBehaviorError:  # the SDK raises on a response cut by length (status "incomplete"): a truncated try
        return 0.0, None
    return _score(result.final_output), None


async def agents_chat_model(client):
    agent = _agent()
    agent.model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    return _score((await Runner.run(agent, QUESTION, max_turns=3)).final_output), None


async def agents_streamed(client):
    result = Runner.run_streamed(_agent(), QUESTION, run_config=RunConfig(model_provider=OpenAIProvider(
        openai_client=client)), max_turns=3)
    try:
        async for _ in result.stream_events():
            pass
    except ModelBehaviorError:  # cut by length, as above
        return 0.0, None
    return _score(result.final_output), None


async def langchain(client):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    bound = llm.bind_tools([CHAT_TOOL])
    reply = await bound.ainvoke(QUESTION)
    text = ""
    async for chunk in bound.astream(QUESTION):
        text += chunk.text if isinstance(chunk.text, str) else chunk.text()
    return _score(reply.content) + _score(text), None


WAYS = [chat_plain, chat_stream, responses_plain, responses_stream, agents_default, agents_chat_model,
        agents_streamed, langchain]


async def agent(client, row):
    """Each episode: the next way; its log line names the way, the episode's key and the tokens the replies said
    were sampled (usage; None where the framework keeps it to itself)."""
    way = WAYS[row["way"] if "way" in row else next(_turn) % len(WAYS)]  # a test's rows may name the way
    reward, tokens = await way(client)
    with open(os.environ["FRAMEWORK_LOG"], "a") as f:
        f.write(json.dumps({"way": way.__name__, "key": client.api_key, "tokens": tokens}) + "\n")
    return reward
