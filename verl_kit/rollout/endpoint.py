"""The OpenAI-compatible endpoint an `--agent` calls (rollout.agents), on FastAPI/uvicorn, at 127.0.0.1 (an ephemeral
port; never beyond loopback). Each request is authenticated by its episode's key (`Authorization: Bearer <key>`, a
fresh random key per episode, valid while the episode runs: a request without one, or with an unknown or expired one,
gets 401); the key also says which episode a request belongs to. Routes:

    POST /v1/chat/completions   stream or not (SSE chunks: the role, the text, tool-call deltas, the finish reason, a
                                usage chunk with stream_options.include_usage, then [DONE])
    POST /v1/responses          the Responses API: input items (messages, function_call, function_call_output),
                                function tools, instructions, previous_response_id within an episode; stream or not
                                (response.created ... response.completed events)
    GET  /v1/models

Both generating routes become one chat request (`Request`) handed to the queue of the generate call playing its
episode (AgentEpisodes._serve), which renders, generates, records and replies with a chat.completion; the Responses
route translates its input into chat messages and that reply into a response. So every token the policy sampled is
recorded once, whichever API and mode the agent used: streaming only formats the finished reply (the policy's batch
generation is not incremental). HTTP handlers never touch the tokenizer, the engine or an episode's state.

Requests are checked against the fields these routes serve (pydantic models, `extra="forbid"`): a field or value
they do not serve (n > 1, stop sequences, a JSON response format, non-function tools, include, ...) is a 400 in
OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, never dropped silently. Sampling fields
(temperature, top_p, seed, penalties) are accepted and not used: the run's sampling makes the training data.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HTTP  # at module level: FastAPI resolves the routes' annotations here

MAX_BODY = 64 << 20  # bytes of one request at most


class EndpointError(Exception):
    """An error reply: HTTP `status`, OpenAI's error message, code and param."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def payload(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Request:
    """One chat-completion request of an episode (the Responses route's too, translated), waiting for its reply."""

    def __init__(self, episode, body: dict):
        self.episode, self.body = episode, body
        self._done = threading.Event()
        self._waiters: list = []
        self._lock = threading.Lock()
        self.status, self.payload = 500, {}

    def reply(self, result: dict | EndpointError) -> None:
        if isinstance(result, EndpointError):
            self.status, self.payload = result.status, result.payload()
        else:
            self.status, self.payload = 200, result
        with self._lock:
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    async def wait_async(self, timeout: float) -> bool:
        """Wait on the event loop (no thread per waiting request: 512 episodes wait at once)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._done.is_set():
                return True
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return False
        return True


# ---- what the routes accept ---------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _ChatFunction(_Loose):
    name: str
    description: str | None = None
    parameters: dict | None = None


class _ChatTool(_Strict):
    type: Literal["function"]
    function: _ChatFunction


class _NamedChatChoice(_Strict):
    type: Literal["function"]
    function: _ChatFunction


class _StreamOptions(_Loose):
    include_usage: bool | None = None


class _TextFormat(_Strict):
    type: Literal["text"]


class _Sampling(_Strict):
    """Accepted and not used: the run's sampling makes the training data."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


class ChatRequest(_Sampling):
    messages: list[dict] = Field(min_length=1)
    tools: list[_ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedChatChoice | None = None
    n: Literal[1] | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool | None = None
    top_logprobs: Literal[0] | None = None
    stop: None = None
    response_format: _TextFormat | None = None
    return_token_ids: bool | None = None  # vLLM's extension: the prompt's and reply's ids


class _ResponsesFunctionTool(_Loose):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class _NamedResponsesChoice(_Strict):
    type: Literal["function"]
    name: str


class _ResponsesText(_Loose):
    format: _TextFormat | None = None


class ResponsesRequest(_Sampling):
    input: str | list[dict]
    instructions: str | None = None
    tools: list[_ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedResponsesChoice | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = Field(default=None, max_length=0)
    text: _ResponsesText | None = None
    reasoning: None = None


def _validated(model: type[BaseModel], body) -> BaseModel:
    """`body` checked against `model`, or a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise EndpointError(400, f"'{where}' is not supported by the training endpoint", "unsupported_parameter",
                                where) from None
        raise EndpointError(400, f"'{where}': {err['msg']} (the training endpoint serves one policy sample per "
                                 "request, text and function tools)", "invalid_value", where) from None


ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat(body) -> dict:
    """A chat-completions request, checked; the body as the rollout thread takes it."""
    request = _validated(ChatRequest, body)
    for i, m in enumerate(request.messages):
        if m.get("role") not in ROLES:
            raise EndpointError(400, f"'messages.{i}.role': one of {', '.join(ROLES)}", "invalid_value",
                                f"messages.{i}.role")
    _check_tool_choice(body.get("tool_choice"), [t.function.name for t in request.tools or []])
    return body


def _check_tool_choice(choice, names: list[str]) -> None:
    if choice in (None, "auto", "none"):
        return
    if not names:
        raise EndpointError(400, "'tool_choice' asks for a tool call and the request has no tools", "invalid_value",
                            "tool_choice")
    name = choice.get("name") or choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name is not None and name not in names:
        raise EndpointError(400, f"'tool_choice' names {name!r}, not one of the request's tools", "invalid_value",
                            "tool_choice")


# ---- the Responses API, over the chat request --------------------------------------------------------------------

def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def response_input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat messages: messages (their text parts), function calls (consecutive ones as one
    assistant message's tool_calls) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    replying = False  # the last message is the assistant's, and a function call that follows belongs to it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise EndpointError(400, f"'input.{i}': an object", "invalid_value", f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            out.append({"role": item["role"], "content": _text_of(item.get("content"))})
            replying = item["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if replying:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                replying = True
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(item.get("output"))})
            replying = False
        else:
            raise EndpointError(400, f"'input.{i}': items of type {kind!r} are not supported by the training endpoint "
                                     "(messages, function_call, function_call_output)", "unsupported_parameter",
                                f"input.{i}")
    return out


def chat_body_of_response(request: ResponsesRequest, body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """The chat request a Responses request makes: its instructions as the system message, then the conversation of
    its previous response (`history`), then its input. Returns it and that conversation without the instructions."""
    conversation = [*history, *response_input_messages(request.input)]
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    if not messages:
        raise EndpointError(400, "'input': nothing to answer", "invalid_value", "input")
    chat = {"messages": messages}
    if request.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                            "parameters": t.parameters or {}}} for t in request.tools]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice["name"]}}
        _check_tool_choice(chat["tool_choice"], [t.name for t in request.tools or []])
    if request.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    if request.max_output_tokens:
        chat["max_tokens"] = request.max_output_tokens
    return chat, conversation


def response_of_completion(response_id: str, request: ResponsesRequest, body: dict, completion: dict,
                           created: int) -> dict:
    """The Response object of a chat.completion: a message item (its text) and a function_call item per tool call."""
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                    "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = completion["usage"]
    length = choice["finish_reason"] == "length"
    return {"id": response_id, "object": "response", "created_at": created,
            "status": "incomplete" if length else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": completion["model"], "output": output,
            "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id, "reasoning": None, "store": request.store,
            "temperature": request.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": request.top_p, "truncation": request.truncation or "disabled",
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]},
            "user": request.user, "metadata": request.metadata or {}}


def response_conversation(conversation: list[dict], response: dict) -> list[dict]:
    """The conversation a later request continues with previous_response_id: this one's, then its output."""
    return [*conversation, *response_input_messages([{"type": "message", "role": "assistant",
                                                      "content": item["content"]} if item["type"] == "message"
                                                     else {k: item[k] for k in ("type", "call_id", "name",
                                                                                "arguments")}
                                                     for item in response["output"]])]


# ---- streaming: the finished reply as server-sent events ---------------------------------------------------------

def chat_chunks(completion: dict, include_usage: bool) -> list[dict]:
    """The chat.completion.chunk objects of a finished completion: the role, the text, one delta per tool call, the
    finish reason, and (include_usage) a last chunk with no choices and the usage."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}

    def chunk(delta, finish=None, logprobs=None):
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}, logprobs=choice.get("logprobs")))
    for i, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": call["function"]["arguments"]}}]}))
    out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**base, "choices": [], "usage": completion["usage"]})
    return out


def response_events(response: dict) -> list[dict]:
    """The Responses stream of a finished response: response.created and .in_progress, each output item added, its
    text or arguments as one delta, done, and response.completed (or .incomplete)."""
    events: list[dict] = []

    def emit(kind, **fields):
        events.append({"type": kind, "sequence_number": len(events), **fields})

    start = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                 part={**part, "text": ""})
            emit("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                 delta=part["text"], logprobs=[])
            emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=part["text"],
                 logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                     "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"],
                 arguments=item["arguments"])
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events


# ---- the server ----------------------------------------------------------------------------------------------------

class Endpoint:
    """The HTTP server (uvicorn, on a daemon thread of its own, started at construction); `url` is what an OpenAI
    client takes as base_url. A request goes to its episode's queue (`episode.jobs`: the generate call that plays the
    episode serves it) as ("request", Request); `model_id`: what /v1/models lists (any `model` is accepted: the
    policy answers every request)."""

    def __init__(self, model_id: str, reply_timeout_s: float = 3600.0):
        import uvicorn

        self.model_id, self.reply_timeout_s = model_id, reply_timeout_s
        self._keys: dict[str, object] = {}
        self._conversations: dict[str, dict[str, list[dict]]] = {}  # key -> response id -> its conversation
        self._lock = threading.Lock()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=300, backlog=4096, limit_concurrency=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="verl_kit-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start")
            time.sleep(0.01)

    def open(self, episode) -> str:
        """A new key for `episode`, valid until close_key."""
        key = "vk-" + secrets.token_urlsafe(24)
        with self._lock:
            self._keys[key] = episode
            self._conversations[key] = {}
        return key

    def close_key(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)
            self._conversations.pop(key, None)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _key(self, http) -> tuple[str, object]:
        """The request's episode key and its episode; 401 without a valid one."""
        auth = http.headers.get("authorization", "")
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
        with self._lock:
            episode = self._keys.get(key) if key else None
        if episode is None:
            raise EndpointError(401, "a valid episode key is required (Authorization: Bearer <key>)",
                                "invalid_api_key")
        return key, episode

    async def _body(self, http) -> Any:
        try:
            size = int(http.headers.get("content-length") or 0)
        except ValueError:
            size = MAX_BODY + 1
        if size > MAX_BODY or size < 0:
            raise EndpointError(400, f"Content-Length {http.headers.get('content-length')!r}: at most {MAX_BODY}")
        raw = await http.body()
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise EndpointError(400, "the request body is not JSON") from None

    async def _completion(self, episode, chat: dict) -> dict:
        """Hand the chat request to the rollout thread and wait for its chat.completion."""
        request = Request(episode, chat)
        episode.jobs.put(("request", request))
        if not await request.wait_async(self.reply_timeout_s):
            raise EndpointError(504, "no reply in time: the run is stuck or stopping")
        if request.status != 200:
            error = request.payload.get("error", {})
            raise EndpointError(request.status, error.get("message", "failed"), error.get("code"))
        return request.payload

    def _app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def sse(lines: list[str]) -> StreamingResponse:
            async def stream():
                for line in lines:
                    yield line
            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        @app.exception_handler(EndpointError)
        async def error(_, e: EndpointError):
            return JSONResponse(e.payload(), status_code=e.status)

        @app.exception_handler(404)
        async def not_found(http, _):
            return JSONResponse(EndpointError(404, f"no route {http.method} {http.url.path}").payload(), 404)

        @app.exception_handler(405)
        async def not_allowed(http, _):
            return JSONResponse(EndpointError(404, f"no route {http.method} {http.url.path}").payload(), 404)

        @app.get("/v1/models")
        async def models(http: HTTP):
            self._key(http)
            return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                               "owned_by": "verl-kit"}]}

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HTTP):
            _, episode = self._key(http)
            body = check_chat(await self._body(http))
            completion = await self._completion(episode, body)
            if not body.get("stream"):
                return completion
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return sse([f"data: {json.dumps(c)}\n\n" for c in chat_chunks(completion, usage)] + ["data: [DONE]\n\n"])

        @app.post("/v1/responses")
        async def responses(http: HTTP):
            key, episode = self._key(http)
            body = await self._body(http)
            request = _validated(ResponsesRequest, body)
            with self._lock:
                stored = self._conversations.get(key, {})
                history = stored.get(request.previous_response_id) if request.previous_response_id else []
            if history is None:
                raise EndpointError(400, f"'previous_response_id': {request.previous_response_id!r} is not a "
                                         "response of this episode", "previous_response_not_found",
                                    "previous_response_id")
            chat, conversation = chat_body_of_response(request, body, history)
            completion = await self._completion(episode, chat)
            response = response_of_completion(f"resp_{uuid.uuid4().hex}", request, body, completion,
                                              int(time.time()))
            with self._lock:
                if key in self._conversations:
                    self._conversations[key][response["id"]] = response_conversation(conversation, response)
            if not request.stream:
                return response
            return sse([f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in response_events(response)])

        return app
