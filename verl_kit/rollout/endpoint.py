"""The OpenAI-compatible endpoint an `--agent` calls (rollout.agents): `POST /v1/chat/completions` and `GET
/v1/models` on 127.0.0.1 (an ephemeral port; never beyond loopback), each request authenticated by its episode's
key (`Authorization: Bearer <key>`, a fresh random key per episode, valid while the episode runs: a request without
one, or with an unknown or expired one, gets 401). The key also says which episode a request belongs to.

The server only parses, authenticates and waits: each request is handed, as a `Request`, to the queue the rollout
thread serves (AgentEpisodes._serve), which renders, generates, records and replies. HTTP threads never touch the
tokenizer, the engine or an episode's state. Errors come back in OpenAI's shape, {"error": {"message", "type",
"code"}}."""

from __future__ import annotations

import json
import queue
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 64 << 20  # bytes of one request at most


class EndpointError(Exception):
    """An error reply: HTTP `status`, OpenAI's error message, type and code."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def payload(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "code": self.code}}


class Request:
    """One chat-completion request of an episode, waiting for its reply."""

    def __init__(self, episode, body: dict):
        self.episode, self.body = episode, body
        self._done = threading.Event()
        self.status, self.payload = 500, {}

    def reply(self, result: dict | EndpointError) -> None:
        if isinstance(result, EndpointError):
            self.status, self.payload = result.status, result.payload()
        else:
            self.status, self.payload = 200, result
        self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


def _check(body) -> dict:
    """The request body, or a 400 naming what is wrong with it."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                                 for m in messages):
        raise EndpointError(400, "'messages' must be a non-empty list of objects with a 'role'", "invalid_messages")
    if body.get("stream"):
        raise EndpointError(400, "streaming is not supported", "unsupported_parameter")
    if body.get("n", 1) != 1:
        raise EndpointError(400, "'n' must be 1: each sample of a group is its own episode", "unsupported_parameter")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise EndpointError(400, "'tools' must be a list of objects", "invalid_tools")
    return body


class _Server(ThreadingHTTPServer):
    request_queue_size = 4096  # the listen backlog: every episode of a step may connect at once (socketserver's is 5)
    daemon_threads = True


class Endpoint:
    """The HTTP server, started at construction on a daemon thread; `url` is what an OpenAI client takes as base_url.
    `jobs`: where requests go, as ("request", Request); `model_id`: what /v1/models lists (any `model` is
    accepted: the policy answers every request)."""

    def __init__(self, jobs: queue.Queue, model_id: str, reply_timeout_s: float = 3600.0):
        self.jobs, self.model_id, self.reply_timeout_s = jobs, model_id, reply_timeout_s
        self._keys: dict[str, object] = {}
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection
            timeout = 300  # an idle connection's thread ends after this long (a socket timeout, not the replies')

            def log_message(self, *args):  # no access log on stderr
                pass

            def do_GET(self):
                endpoint._handle(self, "GET")

            def do_POST(self):
                endpoint._handle(self, "POST")

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        threading.Thread(target=self._server.serve_forever, name="verl_kit-endpoint", daemon=True).start()

    def open(self, episode) -> str:
        """A new key for `episode`, valid until close_key."""
        key = "vk-" + secrets.token_urlsafe(24)
        with self._lock:
            self._keys[key] = episode
        return key

    def close_key(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _episode(self, handler) -> object:
        auth = handler.headers.get("Authorization", "")
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
        with self._lock:
            episode = self._keys.get(key) if key else None
        if episode is None:
            raise EndpointError(401, "a valid episode key is required (Authorization: Bearer <key>)", "invalid_api_key")
        return episode

    def _handle(self, handler, method: str) -> None:
        path = handler.path.split("?", 1)[0].rstrip("/")
        try:
            try:
                size = int(handler.headers.get("Content-Length") or 0)
            except ValueError:
                size = MAX_BODY + 1
            if size > MAX_BODY or size < 0:
                handler.close_connection = True
                raise EndpointError(400, f"Content-Length {handler.headers.get('Content-Length')!r}: at most "
                                         f"{MAX_BODY}")
            raw = handler.rfile.read(size) if size else b""  # read first: the connection is kept for the next one
            episode = self._episode(handler)
            if method == "GET" and path == "/v1/models":
                status, payload = 200, {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                                    "created": 0, "owned_by": "verl-kit"}]}
            elif method == "POST" and path == "/v1/chat/completions":
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    raise EndpointError(400, "the request body is not JSON") from None
                request = Request(episode, _check(body))
                self.jobs.put(("request", request))
                if not request.wait(self.reply_timeout_s):
                    raise EndpointError(504, "no reply in time: the run is stuck or stopping")
                status, payload = request.status, request.payload
            else:
                raise EndpointError(404, f"no route {method} {path}")
        except EndpointError as e:
            status, payload = e.status, e.payload()
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
