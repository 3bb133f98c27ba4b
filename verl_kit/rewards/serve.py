"""Serve a reward model once for several runs (OpenRLHF's serve_rm, slime's remote RM): an HF sequence-classification
export (recipes/reward_model.py's `final/`, or any with num_labels=1) scored over HTTP, on FastAPI/uvicorn.

    python -m verl_kit.rewards.serve --model out/rm/final --port 8100
    VERL_KIT_REWARD_KEY=$(cat KEYFILE) python recipes/grpo.py --reward_model_url http://127.0.0.1:8100 ...

Routes (every one needs `Authorization: Bearer <key>`, 401 otherwise: vllm_server.RequireKey):

    GET  /info     {"model": its directory name, "max_length": tokens read per sample}
    GET  /health   {"status": "ok"}
    POST /score    {"prompts": [str or chat messages, ...], "completions": [str, ...]} -> {"scores": [float, ...]}

A sample is rendered and tokenized as a run's own reward model does it (rewards.combined.RewardModel: the model's
tokenizer and chat template), so a served score equals the local one. Requests are scored one at a time (one model);
a bad body is a 400 naming the field. The key is VERL_KIT_REWARD_KEY when set, else a fresh one written to a 0600 file
whose path is printed. Loopback by default; beyond it the server needs TLS (--ssl_certfile/--ssl_keyfile; clients
verify it with --reward_model_ca_file) or --allow_insecure_http, as the kit's vLLM server does.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import threading
from typing import Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verl_kit.errors import UserError
from verl_kit.rewards.remote import KEY_ENV

logger = logging.getLogger(__name__)

MAX_SAMPLES = 65536  # of one request


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[Union[str, list[Message]]] = Field(max_length=MAX_SAMPLES)
    completions: list[str] = Field(max_length=MAX_SAMPLES)

    @model_validator(mode="after")
    def same_length(self):
        if len(self.prompts) != len(self.completions):
            raise ValueError(f"{len(self.prompts)} prompts for {len(self.completions)} completions")
        return self


def app(reward_model, key: str):
    """The FastAPI app scoring with `reward_model` (a RewardModel), behind `key`."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from verl_kit.rollout.vllm_server import RequireKey

    api = FastAPI(title="verl-kit reward model", docs_url=None, redoc_url=None, openapi_url=None)
    api.add_middleware(RequireKey, key=key)
    lock = threading.Lock()  # one model: requests are scored one after the other
    name = os.path.basename(reward_model.name.rstrip("/")) or "reward_model"

    @api.exception_handler(RequestValidationError)
    async def bad_request(_, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return JSONResponse({"error": f"{where + ': ' if where else ''}{first.get('msg')}"}, status_code=400)

    @api.get("/info")
    def info():
        return {"model": name, "max_length": reward_model.max_length}

    @api.get("/health")
    def health():
        return {"status": "ok"}

    @api.post("/score")
    def score(request: ScoreRequest):  # a plain def: FastAPI runs it on its thread pool, off the event loop
        prompts = [p if isinstance(p, str) else [m.model_dump() for m in p] for p in request.prompts]
        with lock:
            return {"scores": reward_model.score(prompts, request.completions).tolist()}

    return api


def main(argv: list[str]) -> None:
    import uvicorn

    from verl_kit.rewards.combined import load_reward_model
    from verl_kit.rollout.vllm_server import check_exposure, check_port_free, server_key, server_url

    ap = argparse.ArgumentParser(prog="python -m verl_kit.rewards.serve",
                                 description="Serve a reward model (an HF sequence classifier) over HTTP.")
    ap.add_argument("--model", required=True, help="the reward model's directory (recipes/reward_model.py's final/)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (beyond loopback: TLS or --allow_insecure_http)")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--max_length", type=int, default=1024, help="tokens of a sample read at most")
    ap.add_argument("--batch_size", type=int, default=16, help="samples per forward pass")
    ap.add_argument("--ssl_certfile", default=None, help="TLS certificate (PEM): the server speaks https")
    ap.add_argument("--ssl_keyfile", default=None, help="its private key (PEM)")
    ap.add_argument("--allow_insecure_http", action="store_true",
                    help="beyond loopback without TLS: the key crosses the network in clear (refused otherwise)")
    args = ap.parse_args(argv)
    check_exposure(args.host, args.ssl_certfile, args.ssl_keyfile, args.allow_insecure_http,
                   ca_flag="--reward_model_ca_file")
    if not os.path.isdir(args.model):
        raise UserError(f"--model {args.model}: no such directory")
    check_port_free(args.host, args.port)
    reward_model = load_reward_model(args.model, lambda load: load().eval(), "cpu", args.max_length, args.batch_size)
    key, where = server_key(KEY_ENV, args.port, "reward-serve")
    url = server_url(args.host, args.port, bool(args.ssl_certfile))
    how = (f"{KEY_ENV}=$(cat {shlex.quote(where)}) " if where else f"the same {KEY_ENV} in its environment: ")
    ca = f" --reward_model_ca_file {shlex.quote(os.path.abspath(args.ssl_certfile))}" if args.ssl_certfile else ""
    print(f"reward model {args.model} at {url}; it requires its key on every request. A run reaches it with\n"
          f"    {how}python recipes/grpo.py --reward_model_url {url}{ca} ...\n", flush=True)
    uvicorn.run(app(reward_model, key), host=args.host, port=args.port, log_level="warning", access_log=False,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
