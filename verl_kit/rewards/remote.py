"""Rewards over HTTP: a reward model served once for several runs (`python -m verl_kit.rewards.serve`, client
`RemoteRewardModel`, the recipes' `--reward_model_url`), and an LLM judge (`LLMJudge`) that asks any OpenAI-compatible
chat endpoint (a vLLM server, a hosted API) to grade each completion against a rubric.

Both go through the run's reward path: the served model is one more reward source (its weight in --reward_weights,
a failed request scored by --reward_fallback and counted in reward/errors or reward/timeouts, or one line naming the
server); the judge is an `async` reward function (awaited per sample, at most --reward_max_concurrency at a time,
each cut at --reward_timeout_s; a reply without a score is a failed call, scored the same way).

    python -m verl_kit.rewards.serve --model out/rm/final --port 8100       # prints the key's file
    VERL_KIT_REWARD_KEY=$(cat KEYFILE) python recipes/ppo.py --reward_fn none --reward_model_url http://127.0.0.1:8100

    # my_rewards.py, then --reward_fn my_rewards.py:judge
    from verl_kit.rewards import LLMJudge
    judge = LLMJudge("http://127.0.0.1:8000/v1", "Qwen/Qwen3-8B", api_key_env="VLLM_API_KEY", structured_output=True)
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import time

import torch

from verl_kit.errors import UserError

logger = logging.getLogger(__name__)

KEY_ENV = "VERL_KIT_REWARD_KEY"  # the reward server's key, on both sides (never on a command line)


class RewardServerError(RuntimeError):
    """A request to a reward server that failed after its retries (unreachable, timed out, a server error)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class RemoteRewardModel:
    """A reward model served by `python -m verl_kit.rewards.serve`: what RewardModel offers a run (`name`, `score`),
    over HTTP. The server renders and tokenizes with the model's own tokenizer and chat template, as RewardModel
    does, and scores exactly what a local one would. The key comes from `key` or VERL_KIT_REWARD_KEY; `ca_file`
    verifies a server with a certificate of its own (https). A connection that fails is retried `retries` times
    (1, 2, 4 s apart: a server restarting); a request gets `timeout_s` (a score of a whole batch). The first request
    (the server's /info, at start) fails in one line: a wrong URL or key stops the run before any step."""

    def __init__(self, url: str, *, key: str | None = None, ca_file: str | None = None, timeout_s: float | None = None,
                 retries: int = 3):
        import requests

        self.url, self.key = url.rstrip("/"), key or os.environ.get(KEY_ENV) or None
        self.verify = ca_file or True
        self.timeout_s, self.retries = timeout_s or 300.0, retries
        self.session = requests.Session()
        try:
            info = self._request("GET", "/info", timeout=30)
        except RewardServerError as e:
            raise UserError(f"--reward_model_url {self.url}: {e}") from None
        self.name, self.max_length = info["model"], info.get("max_length")
        logger.info("reward model %s served at %s", self.name, self.url)

    def _request(self, method: str, path: str, timeout: float, **kwargs) -> dict:
        import requests

        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        for attempt in range(self.retries + 1):
            try:
                r = self.session.request(method, self.url + path, headers=headers, timeout=timeout,
                                         verify=self.verify, **kwargs)
            except requests.exceptions.SSLError as e:
                raise UserError(f"--reward_model_url {self.url}: TLS verification failed ({e.__class__.__name__}); "
                                "pass the server's certificate as --reward_model_ca_file") from None
            except requests.Timeout:
                raise RewardServerError(f"no reply within {timeout:g} s", timed_out=True) from None
            except requests.ConnectionError as e:
                if attempt == self.retries:
                    raise RewardServerError(f"unreachable after {self.retries + 1} tries "
                                            f"({type(e).__name__})") from None
                time.sleep(2 ** attempt)
                continue
            if r.status_code in (401, 403):
                raise UserError(f"--reward_model_url {self.url}: the server refused the key (HTTP {r.status_code}); "
                                f"set {KEY_ENV} to the key it printed")
            if r.status_code != 200:
                raise RewardServerError(f"HTTP {r.status_code}: {r.text[:200]}")
            return r.json()
        raise AssertionError("unreachable")

    def score(self, prompts: list, completions: list[str]) -> torch.Tensor:
        """(B,) scores of the samples, as the served model's RewardModel.score gives them."""
        out = self._request("POST", "/score", timeout=self.timeout_s,
                            json={"prompts": list(prompts), "completions": list(completions)})["scores"]
        if len(out) != len(completions):
            raise RewardServerError(f"{len(out)} scores for {len(completions)} samples")
        return torch.tensor(out, dtype=torch.float32)


# ---- the judge ------------------------------------------------------------------------------------------------------

RUBRIC = """Grade the reply to the request below.

Request:
{prompt}

Reply:
{completion}

How well does the reply fulfil the request? Give a whole number from 0 (not at all) to {max_score} (perfectly), \
written as "Score: N", and nothing else."""


def render_prompt(prompt) -> str:
    """A dataset prompt as the judge reads it: a string as it is, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


_SCORE = re.compile(r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_score(reply: str, max_score: float) -> float:
    """The judge's grade in [0, 1]: the last "Score: N" in its reply (or a reply that is only a number) over
    `max_score`. A reply without one, or a grade outside [0, max_score], raises ValueError (a failed call)."""
    found = _SCORE.findall(reply) or re.findall(r"^\s*(-?\d+(?:\.\d+)?)\s*$", reply)
    if not found:
        raise ValueError(f"the judge's reply has no score: {reply[:80]!r}")
    value = float(found[-1])
    if not 0 <= value <= max_score:
        raise ValueError(f"the judge's score {value:g} is outside [0, {max_score:g}]")
    return value / max_score


class LLMJudge:
    """An LLM-as-judge reward function: each completion's grade in [0, 1] from an OpenAI-compatible chat endpoint
    (`base_url` ending in /v1; `model` its model name), asked with `rubric` (a str.format template: `{prompt}`,
    `{completion}`, `{max_score}` and any dataset column of the row, e.g. `{answer}`; default RUBRIC) and read by
    parse_score. Greedy by default (`temperature` 0) so a grade is repeatable. `structured_output` (vLLM servers
    only: other APIs refuse the field) constrains the reply to "Score: N" with vLLM's structured outputs, so every
    reply parses. The key: `api_key`, else the environment variable `api_key_env`; `ca_file` verifies an https
    server with a certificate of its own. The run awaits it once per sample (an async reward function: at most
    --reward_max_concurrency requests in flight, each cut at --reward_timeout_s, failures scored by
    --reward_fallback)."""

    def __init__(self, base_url: str, model: str, *, rubric: str = RUBRIC, max_score: int = 10,
                 api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY", ca_file: str | None = None,
                 temperature: float = 0.0, max_tokens: int = 16, structured_output: bool = False,
                 request_timeout_s: float = 120.0, name: str = "llm_judge"):
        if max_score < 1:
            raise UserError(f"LLMJudge max_score={max_score}: use a whole number >= 1")
        self.base_url, self.model, self.rubric, self.max_score = base_url.rstrip("/"), model, rubric, int(max_score)
        self.api_key = api_key or os.environ.get(api_key_env) or None
        self.ca_file, self.temperature, self.max_tokens = ca_file, temperature, max_tokens
        self.structured_output, self.request_timeout_s = structured_output, request_timeout_s
        self.__name__ = name  # the reward's metric name (rewards/<name>/...)

    def messages(self, prompt, completion: str, row: dict) -> list[dict]:
        """The judge's request for one sample: the rubric filled in, as one user message."""
        fields = {**row, "prompt": render_prompt(prompt), "completion": completion, "max_score": self.max_score}
        try:
            return [{"role": "user", "content": self.rubric.format_map(fields)}]
        except (KeyError, IndexError) as e:
            raise UserError(f"LLMJudge rubric: field {e} is neither prompt, completion, max_score nor a dataset column "
                            f"(columns: {sorted(row)})") from None

    def body(self, prompt, completion: str, row: dict) -> dict:
        body = {"model": self.model, "messages": self.messages(prompt, completion, row),
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.structured_output:
            grades = "|".join(str(n) for n in range(self.max_score, -1, -1))  # longest first: "10" before "1"
            body["structured_outputs"] = {"regex": f"Score: ({grades})"}
        return body

    async def __call__(self, prompts: list, completions: list[str], **columns) -> list[float]:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out = []
        # httpx takes a CA file as an SSL context (a path string is deprecated there)
        verify = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else True
        async with httpx.AsyncClient(verify=verify, timeout=self.request_timeout_s, headers=headers) as client:
            for i, (prompt, completion) in enumerate(zip(prompts, completions)):
                row = {k: v[i] for k, v in columns.items() if k != "completion_ids"}
                r = await client.post(self.base_url + "/chat/completions", json=self.body(prompt, completion, row))
                if r.status_code in (401, 403):
                    raise UserError(f"LLMJudge {self.base_url}: the server refused the key (HTTP {r.status_code})")
                r.raise_for_status()
                out.append(parse_score(r.json()["choices"][0]["message"]["content"] or "", self.max_score))
        return out
