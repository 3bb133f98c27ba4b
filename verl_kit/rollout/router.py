"""Several vLLM servers behind one backend (`--vllm_server_url a,b` or `--vllm_num_servers N`): VLLMServers routes
each request's prompts over the servers and syncs every one.

Routing (`route`): a prompt goes, with all its `n` samples (a GRPO group is one prompt with n samples: never split),
to one server. A prompt that extends one routed since the last sync (an episode's next turn, an agent's next call;
the same prompt again: the other members of a group played as episodes) goes where that one went: its prefix is in
that server's cache. Any other prompt goes to the server with the least work in flight (samples requested and not
yet returned, over every thread of this process). prime-rl measured why affinity beats hashing: hash-sticky routing
cut its prefix-cache hit rate from 98% to 5% and slowed generation about 4x (prime-rl PR #3255). The homes are
forgotten at each sync, when every server's prefix cache is reset anyway.

A server that fails a request (after its client's retries and timeouts) is dropped: its prompts go to the others, the
run says so once, and every process drops it at the next sync (agreed by a collective, so the syncs and probes stay
in step). With none left the run stops with one line naming them. Every live server is synced each step (one
gather of the weights, every bucket sent to each server) and checked by its own probe; the probe's metrics are the
worst over the servers.
"""

from __future__ import annotations

import bisect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from verl_kit.rollout.synced import SyncedBackend
from verl_kit.rollout.types import Rollout, SamplingParams, concat_rollouts, select_rows
from verl_kit.rollout.vllm_client import VLLMServer
from verl_kit.train.distributed import reduce_metrics

logger = logging.getLogger(__name__)


class Homes:
    """Which server each prompt routed since the last sync went to, found again by any prompt that extends it."""

    def __init__(self):
        self.by_length: dict[int, dict[tuple[int, ...], int]] = {}
        self.lengths: list[int] = []  # sorted

    def add(self, prompt: list[int], server: int) -> None:
        if len(prompt) not in self.by_length:
            bisect.insort(self.lengths, len(prompt))
            self.by_length[len(prompt)] = {}
        self.by_length[len(prompt)][tuple(prompt)] = server

    def find(self, prompt: list[int]) -> int | None:
        """The home of the longest routed prompt that `prompt` starts with (or is), else None."""
        for n in reversed(self.lengths[:bisect.bisect_right(self.lengths, len(prompt))]):
            home = self.by_length[n].get(tuple(prompt[:n]))
            if home is not None:
                return home
        return None

    def forget(self, server: int | None = None) -> None:
        """Every home (at a sync), or those of one dropped server."""
        if server is None:
            self.by_length, self.lengths = {}, []
            return
        for routes in self.by_length.values():
            for key in [k for k, v in routes.items() if v == server]:
                del routes[key]


def route(prompts: list[list[int]], n: int, alive: list[int], load: dict[int, int], homes: Homes) -> list[int]:
    """The server of each prompt (of those in `alive`): its home when a routed prompt is a prefix of it, else the
    least loaded (`load`: samples in flight per server, counted up here as prompts are placed, `n` each; ties go to
    the first). Records the new homes."""
    out = []
    for p in prompts:
        home = homes.find(p)
        server = home if home in alive else min(alive, key=lambda s: (load[s], alive.index(s)))
        load[server] += n
        homes.add(p, server)
        out.append(server)
    return out


class VLLMServers(SyncedBackend):
    """Clients of several vLLM servers as one RolloutBackend (see the module docstring). Every training process
    holds one over the same servers; only process 0 pushes weights (`pushes`, as for one server)."""

    per_sample_seeds = False

    def __init__(self, servers: list[VLLMServer]):
        if len(servers) < 2:
            raise ValueError("VLLMServers routes over two servers or more; one is a VLLMServer")
        self.servers = servers
        self.alive = list(range(len(servers)))
        self.failed: dict[int, str] = {}  # server -> why, noticed here and not yet agreed at a sync
        self.load = dict.fromkeys(self.alive, 0)
        self.homes = Homes()
        self.routed = [0] * len(servers)  # prompts each server answered since the start (rollout/server_share_max)
        self.last_routes: list[int] = []  # the server that answered each prompt of the last generate call
        self._lock = threading.Lock()
        first = servers[0]
        self.sharding, self.bucket_mb, self.sync_timeout_s = first.sharding, first.bucket_mb, first.sync_timeout_s
        self.transport, self.probe = first.transport, None  # each server has its own probe (load_weights)
        self.lora_rank = first.lora_rank

    @property
    def pushes(self) -> bool:
        return self.servers[0].pushes

    @property
    def stream_address(self) -> str:
        """The address the servers reach this process's stream at: the one facing the first server's host (servers
        on hosts behind other interfaces of this one are not supported)."""
        return self.servers[0].stream_address

    @property
    def same_host(self) -> bool:
        return all(self.servers[i].same_host for i in self.alive)

    @property
    def stream_tls(self) -> bool:
        return any(s.stream_tls for s in self.servers)

    def _drop(self, server: int, why: str) -> None:
        with self._lock:
            if server not in self.alive:
                return
            self.alive.remove(server)
            self.failed[server] = why
            self.homes.forget(server)
            left = [self.servers[i].url for i in self.alive]
        logger.warning("vLLM server %s failed (%s): dropped; its requests go to %s", self.servers[server].url, why,
                       ", ".join(left) or "no other server")
        if not left:
            self._none_left()

    def _none_left(self):
        raise RuntimeError("every vLLM server failed: " + "; ".join(
            f"{self.servers[i].url}: {why}" for i, why in sorted(self.failed.items())))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """Each prompt with its params.n samples on one server, the servers' parts sent together; the rows in the
        order of `prompts`, as one server returns them."""
        rows: dict[int, Rollout] = {}  # prompt index -> its rollout (n rows)
        served = [0] * len(prompts)  # prompt index -> the server that answered it
        todo = list(range(len(prompts)))
        while todo:
            with self._lock:
                if not self.alive:
                    self._none_left()
                servers = route([prompts[i] for i in todo], params.n, self.alive, self.load, self.homes)
            parts: dict[int, list[int]] = {}
            for i, s in zip(todo, servers):
                parts.setdefault(s, []).append(i)
            with ThreadPoolExecutor(len(parts)) as pool:
                futures = {s: pool.submit(self._generate_on, s, [prompts[i] for i in idx], params)
                           for s, idx in parts.items()}
            todo = []
            for s, future in futures.items():
                try:
                    ro = future.result()
                except RuntimeError as e:  # the client's retries and timeouts are spent: the server is gone
                    self._drop(s, str(e).splitlines()[0][:200])
                    todo += parts[s]
                    continue
                for k, i in enumerate(parts[s]):
                    rows[i], served[i] = select_rows(ro, list(range(k * params.n, (k + 1) * params.n))), s
        self.last_routes = served
        return concat_rollouts([rows[i] for i in range(len(prompts))])

    def _generate_on(self, server: int, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        try:
            ro = self.servers[server].generate(prompts, params)
        finally:
            with self._lock:
                self.load[server] -= params.n * len(prompts)
        with self._lock:
            self.routed[server] += len(prompts)
        return ro

    # vLLM's weight-transfer API (SyncedBackend), each call to every live server; a server that fails one is dropped.
    def _each(self, call: str, *args) -> None:
        for i in list(self.alive):
            try:
                getattr(self.servers[i], call)(*args)
            except RuntimeError as e:
                self._drop(i, f"weight sync: {str(e).splitlines()[0][:200]}")

    def init_weight_transfer_engine(self, seconds: float) -> None:
        self._each("init_weight_transfer_engine", seconds)

    def start_weight_update(self, seconds: float) -> None:
        self._each("start_weight_update", seconds)

    def update_weights(self, refs: list[str], seconds: float) -> None:
        self._each("update_weights", refs, seconds)

    def finish_weight_update(self, version: int, seconds: float) -> None:
        self._each("finish_weight_update", version, seconds)

    def shutdown_weight_transfer_engine(self, seconds: float) -> None:
        self._each("shutdown_weight_transfer_engine", seconds)

    def load_adapter(self, name: str, path: str, version: int, seconds: float) -> None:
        self._each("load_adapter", name, path, version, seconds)

    def pause_generation(self, seconds: float) -> None:
        self._each("pause_generation", seconds)

    def resume_generation(self, seconds: float) -> None:
        self._each("resume_generation", seconds)

    def engines_fed(self) -> int:
        return len(self.alive)

    def _agree(self) -> None:
        """Every process drops the servers any process found failed (a collective), so syncs and probes stay in
        step."""
        with self._lock:
            failed = {f"failed{i}": float(i not in self.alive) for i in range(len(self.servers))}
        agreed = reduce_metrics({}, failed)
        for i in range(len(self.servers)):
            if agreed[f"failed{i}"] and i in self.alive:
                self._drop(i, "failed on another process")

    def load_weights(self, actor, version: int = 0, in_flight: bool = False) -> dict:
        """One gather of the weights, every bucket to each live server (each paused meanwhile when `in_flight`),
        then each server's probe; the homes are forgotten (every server's prefix cache was reset). Collective."""
        metrics = super().load_weights(actor, version, in_flight)
        differ = self._differing_servers()
        self._agree()  # the servers dropped here or elsewhere, during generation or this sync: probed nowhere
        if reduce_metrics({}, {"differ": float(bool(differ))})["differ"]:
            raise RuntimeError(f"weight sync: the servers hold different weights after it (vLLM's /weight_checker: "
                               f"{', '.join(differ) or 'found on another process'} differ from "
                               f"{self.servers[self.alive[0]].url}); stopping rather than sampling from two policies")
        probes = [self.servers[i].probe.check(self.servers[i].score, actor, self.pushes)
                  for i in self.alive if self.servers[i].probe is not None]
        for name in probes[0] if probes else ():
            metrics[name] = max(p[name] for p in probes)  # the worst server
        with self._lock:
            self.homes.forget()
            metrics["sync/servers"] = len(self.alive)
            total = max(sum(self.routed), 1)
            metrics["rollout/server_share_max"] = max(self.routed) / total  # 1/servers: spread evenly
        return metrics

    def _differing_servers(self) -> list[str]:
        """The exact check beside each server's probe (which bounds each against the trainer): every live server's
        weight checksums (vLLM's /weight_checker) must equal the first's after a sync. The URLs of those that
        differ; a server that does not answer is dropped. Only on the process that pushes (the others: [])."""
        if not self.pushes:
            return []
        with ThreadPoolExecutor(len(self.alive)) as pool:
            futures = {i: pool.submit(self.servers[i].weight_checksums, self.sync_timeout_s) for i in self.alive}
        sums = {}
        for i, future in futures.items():
            try:
                sums[i] = future.result()
            except RuntimeError as e:
                self._drop(i, f"weight check: {str(e).splitlines()[0][:200]}")
        first = next(iter(sums.values()), None)
        return [self.servers[i].url for i, s in sums.items() if s != first]

    def score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        return self.servers[self.alive[0]].score(seqs)

    def close(self) -> None:
        """Ask each live server to unmap this run's weight-sync slots (VLLMServer.close, for the slots held here)."""
        self._close_transports()
