"""What the two vLLM backends share (rollout.vllm_engine.VLLMColocated, rollout.vllm_client.VLLMServer):
`SyncedBackend`, the weight sync into the engine through vLLM's weight-transfer API (rollout.weight_sync drives it,
rollout.worker_extension is the engine on the workers' side) followed by the probe; `to_rollout`, an engine's
completions as a Rollout; and `orphan_guard`, this process's guard over the vLLM processes it starts
(verl_kit.launch.processes), which also removes its weight-sync slots when it dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time

import torch

from verl_kit.errors import UserError
from verl_kit.launch import processes
from verl_kit.rollout.probe import Probe
from verl_kit.rollout.transport import SLOT_NAME, SharedBuckets, StreamedBuckets, slot_dir
from verl_kit.rollout.types import Rollout, Sample, rollout_of_samples
from verl_kit.rollout.weight_sync import sync_weights, write_adapter

logger = logging.getLogger(__name__)

# The worker extension an engine the kit syncs loads (it registers WEIGHT_TRANSFER_BACKEND with vLLM's factory in
# each worker), and the engine's weight_transfer_config.
WORKER_EXTENSION = "verl_kit.rollout.worker_extension.WorkerExtension"
WEIGHT_TRANSFER_BACKEND = "verl_kit"
WEIGHT_TRANSFER_CONFIG = {"backend": WEIGHT_TRANSFER_BACKEND}


def vllm_lora_rank(rank: int) -> int:
    """The engine's LoRA slot for an adapter of rank `rank`: vLLM's ranks are 1, 8, 16, 32, ... 512, and a larger slot
    serves a smaller adapter."""
    return min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def orphan_guard() -> processes.OrphanGuard:
    """This process's orphan guard (started on first use), told where this process's weight-sync slots live."""
    return processes.orphan_guard(files=(slot_dir(), SLOT_NAME.pattern))


def to_rollout(prompts_n: list[list[int]], completions: list[tuple[list[int], list[float], bool, list | None]],
               pad: int) -> Rollout:
    """(token ids, sampled-token log-probs, truncated, vLLM's weight_versions spans or None) per response -> Rollout.
    The engine stops at (and keeps) the EOS, so every returned token is a sampled response token."""
    for ids, lps, _, _ in completions:
        if len(ids) != len(lps):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} log-probs")
    return rollout_of_samples([Sample(p, ids, [True] * len(ids), lps, truncated, token_versions(spans, len(ids)))
                               for p, (ids, lps, truncated, spans) in zip(prompts_n, completions)], pad)


def token_versions(spans: list | None, n: int) -> list[int] | None:
    """vLLM's `weight_versions` of a response (spans of output tokens `[start, end)` sampled by the weights labelled
    `version`; the kit labels each sync with its optimizer step) -> each token's version; None when the engine gave
    none or a label that is not the kit's (an engine not synced by it, an adapter-only sync)."""
    if not spans:
        return None
    out = [-1] * n
    for span in spans:
        v, start, end = (span["version"], span["start"], span["end"]) if isinstance(span, dict) else \
            (span.version, span.start, span.end)
        if not str(v).isdigit():
            return None
        out[start:end] = [int(v)] * (end - start)
    return out


class SyncedBackend:
    """Shared by both vLLM backends: the weight sync into the engine through vLLM's weight-transfer API, then the
    probe. A backend implements the API's calls (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
    `finish_weight_update`, `shutdown_weight_transfer_engine`, each with a deadline in seconds); `transport`: "auto"
    (same-host slots in /dev/shm when the engine runs on this host, else the stream) or "stream" (every bucket's bytes
    over HTTP from this process; --vllm_weight_sync_transport)."""

    probe: Probe | None
    bucket_mb: float
    sync_timeout_s: float
    transport: str = "auto"
    sharding = None  # the run's train.Sharding, which gathers the actor's full tensors (None: they are whole)
    stream_address = "127.0.0.1"  # where the engines reach this process's StreamedBuckets
    stream_tls = False  # whether the stream speaks TLS (it does to a server that does)
    # The rank of the actor's LoRA adapter when the engine serves it (vLLM's LoRA over the base weights): each sync
    # then sends the adapter alone (`load_adapter`); None: the weights are synced whole (a LoRA actor's merged).
    lora_rank: int | None = None

    def keep_prefixes(self) -> contextlib.AbstractContextManager:
        """A no-op: a vLLM engine caches prompt prefixes itself (RolloutBackend.keep_prefixes)."""
        return contextlib.nullcontext()

    def init_weight_transfer_engine(self, seconds: float) -> None:
        """init_weight_transfer_engine, once, before the first update."""
        raise NotImplementedError

    def start_weight_update(self, seconds: float) -> None:
        """start_weight_update."""
        raise NotImplementedError

    def update_weights(self, refs: list[str], seconds: float) -> None:
        """update_weights with these buckets' references (rollout.transport)."""
        raise NotImplementedError

    def finish_weight_update(self, version: int, seconds: float) -> None:
        """finish_weight_update (tagged with the policy version), then the prefix cache reset: KV of the old policy
        must not be reused."""
        raise NotImplementedError

    def shutdown_weight_transfer_engine(self, seconds: float) -> None:
        """shutdown_weight_transfer_engine: the engine drops what this trainer left mapped."""
        raise NotImplementedError

    def pause_generation(self, seconds: float) -> None:
        """vLLM's pause with mode "keep" (--partial_rollout): the engine stops between two steps, keeping its running
        requests, which continue after resume_generation under the weights loaded meanwhile."""
        raise UserError("--partial_rollout: this engine cannot pause its requests mid-generation")

    def resume_generation(self, seconds: float) -> None:
        raise NotImplementedError

    def load_adapter(self, name: str, path: str, version: int, seconds: float) -> None:
        """The adapter-only sync's one call: from its next request the engine serves the adapter in folder `path`
        (peft's files) as `name`, a name not used before (vLLM caches an adapter by its name and id: one re-sent under
        the same one is silently stale), its tokens labelled `version`."""
        raise NotImplementedError

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        raise NotImplementedError

    _shared: SharedBuckets | None = None  # the same-host slots, created at the first sync that uses them
    _streamed: StreamedBuckets | None = None  # the stream, created at the first bucket that travels by it
    _initialized = False

    def _stream(self) -> StreamedBuckets:
        if self._streamed is None:
            self._streamed = StreamedBuckets(self.stream_address, tls=self.stream_tls)
            logger.info("weight sync: the engines pull buckets from %s%s", self._streamed.url,
                        " (TLS, this process's own certificate)" if self.stream_tls else "")
        return self._streamed

    def _close_transports(self, release: bool = True) -> None:
        """Close the slots and the stream; `release`: first ask the engine to drop its mappings of the slots (which
        would otherwise hold their memory in /dev/shm until the next run's first sync)."""
        if release and self._initialized and self._shared is not None and self._shared.slots:
            try:
                self.shutdown_weight_transfer_engine(30)
            except RuntimeError as e:  # an engine that is gone holds nothing
                logger.warning("weight sync: the engine did not release this run's slots: %s", e)
        for carrier in (self._shared, self._streamed):
            if carrier is not None:
                carrier.close()
        self._shared = self._streamed = None
        self._initialized = False
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root, self._adapters = None, []

    @property
    def pushes(self) -> bool:
        return True

    @property
    def same_host(self) -> bool:
        """Whether the engine's workers run on this host (and read buckets from its /dev/shm)."""
        return True

    def load_weights(self, actor, version: int = 0, in_flight: bool = False) -> dict:
        """Weight sync + probe. Collective: every training process calls it at the same point, after each update.
        Returns sync/* metrics (`version`: the optimizer step that produced these weights, the policy version the
        next rollouts come from) and the probe's rollout/* metrics; raises RuntimeError when the probe fails.
        `in_flight` (--partial_rollout): requests may be generating; the engine is paused keeping them, updated (the
        KV of the running requests is dropped with the prefix cache: they are recomputed under the new weights, as a
        preempted request is), then resumed; their tokens from here on are sampled by `version`."""
        if self.lora_rank is not None:  # config: never in flight (a running request keeps its adapter)
            return self._probed(actor, self._sync_adapter(actor, version))
        pause = in_flight and self.pushes
        if pause:
            self.pause_generation(self.sync_timeout_s)
        try:
            metrics = self._sync(actor, version)
        finally:
            if pause:
                self.resume_generation(self.sync_timeout_s)
        return self._probed(actor, metrics)

    def _sync(self, actor, version: int) -> dict:
        """The weights into the engine (sync/* metrics), no probe."""
        slots = self.pushes and self.same_host and self.transport == "auto" and os.path.isdir("/dev/shm")
        if slots and self._shared is None:
            self._shared = SharedBuckets()
        if self.pushes and not self._initialized:
            self.init_weight_transfer_engine(self.sync_timeout_s)
            self._initialized = True
        metrics = sync_weights(actor, self if self.pushes else None, self.bucket_mb, self.sync_timeout_s,
                               self._shared if slots else None, self._stream, self.sharding, version)
        metrics["sync/bytes"] *= self.engines_fed()
        return metrics

    _adapter_root: str | None = None  # the private folder of this process's adapter files (adapter-only syncs)
    _adapters: list[str] = []  # the folders of the adapters synced last, oldest first

    def _sync_adapter(self, actor, version: int) -> dict:
        """The adapter-only sync: the adapter gathered (every process joins) and written by the process that pushes
        into a new folder of its private folder (0700; an engine on this host reads it), which the engine loads as
        `policy-v{version}`. The folder of the adapter before stays one sync longer (a request of that version still
        running may need it), older ones are removed. sync/* metrics."""
        t0 = time.time()
        path = None
        if self.pushes:
            if self._adapter_root is None:
                self._adapter_root = tempfile.mkdtemp(prefix="verl_kit-adapters-")
            path = os.path.join(self._adapter_root, f"v{version}")
            shutil.rmtree(path, ignore_errors=True)
        n_bytes = write_adapter(actor, path, self.sharding)
        if self.pushes:
            self.load_adapter(f"policy-v{version}", path, version, self.sync_timeout_s)
            self._adapters = [a for a in self._adapters if a != path] + [path]
            for old in self._adapters[:-2]:
                shutil.rmtree(old, ignore_errors=True)
            self._adapters = self._adapters[-2:]
        seconds = time.time() - t0
        n_bytes *= self.engines_fed()
        return {"sync/seconds": seconds, "sync/bytes": n_bytes, "sync/buckets": 1,
                "sync/bytes_per_s": n_bytes / max(seconds, 1e-9), "sync/adapter_only": 1, "sync/version": version}

    def engines_fed(self) -> int:
        """Engines that received this sync (sync/bytes counts the bytes of each)."""
        return 1

    def _probed(self, actor, metrics: dict) -> dict:
        """`metrics` with the probe's, once the engine holds the synced weights (raises when the probe fails)."""
        if self.probe is not None:
            metrics.update(self.probe.check(self.score, actor, self.pushes))
        return metrics
