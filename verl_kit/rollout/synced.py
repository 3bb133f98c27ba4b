"""What the two vLLM backends share (rollout.vllm_engine.VLLMColocated, rollout.vllm_client.VLLMServer):
`SyncedBackend`, the weight sync into the engine (rollout.weight_sync) followed by the probe; `to_rollout`, an engine's
completions as a Rollout; and `orphan_guard`, this process's guard over the vLLM processes it starts
(verl_kit.launch.processes), which also removes its weight-sync slots when it dies.
"""

from __future__ import annotations

import contextlib
import os

import torch

from verl_kit.launch import processes
from verl_kit.rollout.probe import Probe
from verl_kit.rollout.transport import SLOT_NAME, SharedBuckets, slot_dir
from verl_kit.rollout.types import Rollout, Sample, rollout_of_samples
from verl_kit.rollout.weight_sync import sync_weights


def orphan_guard() -> processes.OrphanGuard:
    """This process's orphan guard (started on first use), told where this process's weight-sync slots live."""
    return processes.orphan_guard(files=(slot_dir(), SLOT_NAME.pattern))


def to_rollout(prompts_n: list[list[int]], completions: list[tuple[list[int], list[float], bool]], pad: int) -> Rollout:
    """(token ids, sampled-token log-probs, truncated) per response -> Rollout. The engine stops at (and keeps) the
    EOS, so every returned token is a sampled response token."""
    for ids, lps, _ in completions:
        if len(ids) != len(lps):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} log-probs")
    return rollout_of_samples([Sample(p, ids, [True] * len(ids), lps, truncated)
                               for p, (ids, lps, truncated) in zip(prompts_n, completions)], pad)


class SyncedBackend:
    """Shared by both vLLM backends: weight sync into the engine, then the probe. `transport`: "auto" (same-host
    slots in /dev/shm when the engine runs on this host) or "inline" (base64 through the RPC;
    --vllm_weight_sync_transport)."""

    probe: Probe | None
    bucket_mb: float
    sync_timeout_s: float
    transport: str = "auto"
    sharding = None  # the run's train.Sharding, which gathers the actor's full tensors (None: they are whole)

    def keep_prefixes(self) -> contextlib.AbstractContextManager:
        """A no-op: a vLLM engine caches prompt prefixes itself (RolloutBackend.keep_prefixes)."""
        return contextlib.nullcontext()

    def _push(self, blobs: list[str], seconds: float) -> None:
        raise NotImplementedError

    def _commit(self, seconds: float) -> None:
        raise NotImplementedError

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        raise NotImplementedError

    _shared: SharedBuckets | None = None  # the same-host slots, created at the first sync that uses them

    def _close_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()

    @property
    def pushes(self) -> bool:
        return True

    @property
    def same_host(self) -> bool:
        """Whether the engine's workers run on this host (and read buckets from its /dev/shm)."""
        return True

    def load_weights(self, actor, version: int = 0) -> dict:
        """Weight sync + probe. Collective: every training process calls it at the same point, after each update.
        Returns weight_sync/* metrics (`version`: the optimizer step that produced these weights, the policy version
        the next rollouts come from) and the probe's rollout/* metrics; raises RuntimeError when the probe fails."""
        slots = self.pushes and self.same_host and self.transport == "auto" and os.path.isdir("/dev/shm")
        if slots and self._shared is None:
            self._shared = SharedBuckets()
        metrics = sync_weights(actor, self._push if self.pushes else None, self._commit if self.pushes else None,
                               self.bucket_mb, self.sync_timeout_s, self._shared if slots else None, self.sharding)
        metrics["weight_sync/version"] = version
        return self._probed(actor, metrics)

    def _probed(self, actor, metrics: dict) -> dict:
        """`metrics` with the probe's, once the engine holds the synced weights (raises when the probe fails)."""
        if self.probe is not None:
            metrics.update(self.probe.check(self.score, actor, self.pushes))
        return metrics
