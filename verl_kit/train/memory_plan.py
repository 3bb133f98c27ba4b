"""The memory plan: before a run loads any weights or starts an engine, what each term of a step will take, against
the memory the run may use (docs/memory.md). Computed, not measured: from the models' configs (parameters counted on
the meta device, no weights read), the flags, the sharding and world size, and the data's lengths (the largest
micro-batch the run can form); the measured peak is logged beside it on every row (`perf/peak_rss_gib`). No
calibration forward: a plan is ready before the first weight is read, in well under a second.

The terms, per process (fp32 unless said):

    model state        trained parameters x 16 B (weights 4, gradients 4, AdamW moments 8), divided by the processes
                       under ZeRO-3 and FSDP2 (ZeRO-1/2: the moments, and gradients at 2); a LoRA run holds its frozen
                       base at 4 B per parameter and trains the adapter's
    frozen models      reference, teacher, reward model: 4 B per parameter, sharded like the state under ZeRO-3/FSDP2
    activations        the largest micro-batch's tokens x layers x (12 x hidden + 2 x KV width + 4 x MLP width)
                       x 4 B kept for the backward (half under bf16; fitted to SmolLM2 measured, activation_bytes);
                       with gradient checkpointing one hidden state per layer (hidden x 4 B) plus twice one layer's
                       activations during its recomputation
    LM-head tiles      one logits tile (at most 4096 positions x 4096 columns, fp32) and two temporaries of its size
                       (train.lm_head)
    rollout engine     HF generate: a plain copy of the policy (4 B per parameter; none where it generates on the
                       trained model, rollout.hf.shares_policy); a colocated vLLM engine (other processes of this
                       node, counted against the same memory): its weights, its KV cache (--vllm_kv_cache_gib on CPU)
                       and ~1.5 GiB of its own processes
    KV cache           HF generate's: every sample this process generates at once (its prompts x generations) at its
                       longest prompt + --max_completion_length, fp32; it exists during generation only, the
                       activations and LM-head tiles during the update only, so the total counts the larger of the two
    rollout client     on CPU, a colocated vLLM engine's share in this process: the vllm library (0.28 GiB resident,
                       measured) and the same-host weight-sync slots, one copy of the synced weights in /dev/shm that
                       this process writes and keeps mapped (rollout.transport)
    this process       what the process holds when the plan is made (Python, torch and the libraries: its resident
                       size now)

The memory the run may use: on CUDA the device's free memory (torch.cuda.mem_get_info; a colocated engine's
--vllm_gpu_memory_utilization taken out; unmeasured on this project's CPU machines); on CPU the smallest of
MemAvailable, the cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes: a container's limit, not the host's) and
RLIMIT_AS / RLIMIT_DATA where set, shared by the node's local processes; --memory_limit_gib sets it by hand. A plan
above the hard limits (the machine's memory or the cgroup's, an rlimit, --memory_limit_gib) is refused in one line
naming its largest term and the flags that move it; above what is available now (other processes hold the rest) it is
one warning.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, field, replace

import torch

from verl_kit.errors import UserError

logger = logging.getLogger(__name__)

GIB = 2 ** 30
TILE = 4096  # train.lm_head's tile: at most 4096 positions x 4096 vocabulary columns, fp32, and two temporaries
ENGINE_PROCESS_BYTES = int(1.5 * GIB)  # a CPU vLLM engine's core and worker beyond its weights and KV cache
VLLM_LIBRARY_BYTES = int(0.28 * GIB)  # what importing vllm adds to the trainer's resident size (measured: 0.28 GiB)


def meta_model(model_path: str):
    """The causal LM at `model_path` built on the meta device (its config read, no weight)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_kit.models.zero3 import outside_zero3

    with outside_zero3(), init_empty_weights():  # never partitioned by a ZeRO-3 run's deepspeed.zero.Init
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    model.tie_weights()  # a tied output layer is the input embedding: counted once
    return model


def parameter_count(model_path: str) -> int:
    """Parameters of the causal LM at `model_path`, counted on the meta device (tied weights once)."""
    return sum(p.numel() for p in meta_model(model_path).parameters())


def adapter_count(model, rank: int, targets: str | None) -> int:
    """Parameters of a rank-`rank` LoRA adapter on `model`'s linear layers named by `targets` (comma-separated last
    names; None or all-linear: every linear layer but the output layer): rank x (inputs + outputs) each."""
    names = None if targets in (None, "", "all-linear") else {t.strip() for t in targets.split(",")}
    out_layer = model.get_output_embeddings()
    return sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and (n.rsplit(".", 1)[-1] in names if names else m is not out_layer))


def activation_bytes(config, tokens: int, checkpointing: bool, bf16: bool) -> int:
    """What a micro-batch of `tokens` keeps for its backward (module docstring). Per layer and token 12 hidden-wide,
    2 KV-wide and 4 MLP-wide values: fitted to one forward + backward of SmolLM2 measured on CPU (1.57-1.64 MB a
    token from 4,096 to 9,664 tokens, sequences of 128 to 2,048 tokens: no term grows with a sequence's length under
    the kit's packed attention; the formula says 1.61), docs/memory.md. With checkpointing, one hidden state per layer
    and twice one layer's values (its recomputation and their gradients; measured 0.19 MB a token, formula 0.17)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    width = 2 if bf16 else 4
    per_layer = (12 * hidden + 2 * kv * head_dim + 4 * mlp) * width
    if checkpointing:
        return tokens * (layers * hidden * 4 + 2 * per_layer)
    return tokens * layers * per_layer


def largest_microbatch(costs: list[int], per_device: int, max_tokens: int | None) -> int:
    """Tokens of the largest micro-batch a run can form from items of `costs` tokens: the `per_device` longest items,
    or at most `max_tokens` (--max_tokens_per_microbatch: never below the longest item)."""
    longest = sorted(costs, reverse=True)
    tokens = sum(longest[:per_device])
    if max_tokens:
        tokens = max(min(tokens, max_tokens), longest[0] if longest else 0)
    return tokens


@dataclass
class Budget:
    """The memory a process may use: `limit` (GiB, hard: beyond it the run cannot fit on an idle machine) and
    `available` (GiB, now), with what each came from."""

    limit: float
    available: float
    sources: dict[str, float] = field(default_factory=dict)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_limit() -> float | None:
    """This process's cgroup memory limit in bytes (v2 memory.max, else v1 memory.limit_in_bytes), None if unlimited."""
    own = _read("/proc/self/cgroup") or ""
    paths = [line.split(":", 2)[2] for line in own.splitlines() if line.count(":") >= 2]
    for rel in paths:
        for path in (f"/sys/fs/cgroup{rel}/memory.max", "/sys/fs/cgroup/memory.max",
                     f"/sys/fs/cgroup/memory{rel}/memory.limit_in_bytes",
                     "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            value = _read(path)
            if value and value != "max" and value.isdigit() and int(value) < 1 << 60:
                return float(value)
    return None


def budget(local_processes: int, memory_limit_gib: float | None, gpu_engine_share: float = 0.0) -> Budget:
    """The run's memory per process (module docstring). `local_processes`: the node's training processes sharing
    it; `gpu_engine_share`: the fraction of a GPU a colocated engine takes (--vllm_gpu_memory_utilization)."""
    if memory_limit_gib is not None:
        return Budget(memory_limit_gib, memory_limit_gib, {"--memory_limit_gib": memory_limit_gib})
    if torch.cuda.is_available():  # unmeasured here: no GPU ran this path
        free, total = torch.cuda.mem_get_info()
        usable = (free - gpu_engine_share * total) / GIB
        return Budget(total * (1 - gpu_engine_share) / GIB, usable, {"cuda free": free / GIB})
    meminfo = dict(line.split(":", 1) for line in (_read("/proc/meminfo") or "").splitlines() if ":" in line)
    kib = lambda k: float(meminfo[k].split()[0]) * 1024 if k in meminfo else None  # noqa: E731
    hard = {"MemTotal": kib("MemTotal"), "cgroup": cgroup_limit()}
    for name, which in (("RLIMIT_AS", resource.RLIMIT_AS), ("RLIMIT_DATA", resource.RLIMIT_DATA)):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY:
            hard[name] = float(soft) * local_processes  # a limit of each process
    hard = {k: v / GIB for k, v in hard.items() if v}
    available = (kib("MemAvailable") or 0) / GIB
    limit = min(hard.values()) if hard else available
    return Budget(limit / local_processes, min(available, limit) / local_processes,
                  {**hard, "MemAvailable": available})


@dataclass
class MemoryPlan:
    """The plan's terms (GiB per process; `engine` the colocated engine's, in other processes) and its budget."""

    terms: dict[str, float]
    notes: dict[str, str]
    budget: Budget
    local_processes: int

    @property
    def total(self) -> float:
        """The terms' sum, where those of generation and those of the update (which never coexist) count as the
        larger of the two groups."""
        apart = [sum(self.terms.get(k, 0.0) for k in group) for group in (GENERATION, UPDATE)]
        return sum(v for k, v in self.terms.items() if k not in GENERATION + UPDATE) + max(apart)

    def table(self) -> str:
        rows = [f"  {name:<16} {gib:7.2f} GiB  {self.notes.get(name, '')}" for name, gib in self.terms.items()]
        src = ", ".join(f"{k} {v:.1f}" for k, v in self.budget.sources.items())
        return ("memory plan per training process (computed from the configs, the flags and the data's lengths; the "
                "measured peak is perf/peak_rss_gib):\n" + "\n".join(rows) +
                f"\n  {'total':<16} {self.total:7.2f} GiB  of {self.budget.available:.2f} GiB available now, "
                f"{self.budget.limit:.2f} GiB at most ({src} GiB; {self.local_processes} process(es) on this node)")

    def metrics(self) -> dict[str, float]:
        return {**{f"memory/plan_{k.replace(' ', '_')}_gib": round(v, 4) for k, v in self.terms.items()},
                "memory/plan_total_gib": round(self.total, 4), "memory/limit_gib": round(self.budget.limit, 4)}

    def check(self) -> None:
        """Refuse a plan above the hard limit in one line; warn above what is available now."""
        largest = max(self.terms, key=self.terms.get)
        if self.total > self.budget.limit:
            term = f"{largest} ({self.terms[largest]:.1f} GiB: {self.notes.get(largest, '')})"
            raise UserError(f"this run needs about {self.total:.1f} GiB per process and may use "
                            f"{self.budget.limit:.1f} GiB (docs/memory.md); its largest term is {term}: "
                            f"{MOVES.get(largest, '')}; or set --memory_limit_gib")
        if self.total > self.budget.available:
            logger.warning("memory plan: %.1f GiB per process, %.1f GiB available now (other processes hold the "
                           "rest): the run may be killed; largest term %s (%.1f GiB)", self.total,
                           self.budget.available, largest, self.terms[largest])


GENERATION = ("KV cache",)  # terms of the generation only (HF generate's cache, dropped before the update)...
UPDATE = ("activations", "LM-head tiles")  # ... and of the update only: a step's peak is the larger of the two

MOVES = {
    "model state": "--use_peft, or ZeRO-3 / FSDP2 over more processes (accelerate_configs/zero3.yaml)",
    "frozen models": "ZeRO-3 / FSDP2 over more processes shard them; --use_peft makes the reference the base model",
    "activations": "--gradient_checkpointing true, a smaller --max_tokens_per_microbatch or "
                   "--per_device_train_batch_size, shorter --max_length",
    "LM-head tiles": "nothing to set",
    "rollout engine": "--vllm_kv_cache_gib, --rollout vllm-server (the engine on other processes or hosts)",
    "KV cache": "fewer --prompts_per_step per process, a shorter --max_completion_length, --rollout vllm",
    "rollout client": "--rollout vllm-server on another host (no slots here)",
    "this process": "nothing to set",
}


def plan(accelerator, tc, model_path: str, costs: list[int], *, frozen: tuple[str, ...] = (),
         trained_extra: tuple[str, ...] = (), rollout=None, vllm=None, generations: int = 1) -> MemoryPlan:
    """The plan of a run: `tc` its TrainConfig (the micro-batch, checkpointing, LoRA, bf16 flags), `model_path` the
    trained policy, `costs` the tokens of each item a micro-batch is made of (a sequence; a preference pair's two; an
    online recipe passes its prompts' ids, each sample counted at its prompt plus --max_completion_length),
    `frozen` the paths of frozen models (reference, teacher, reward model), `trained_extra` other trained models (a
    critic), `rollout` and `vllm` an online recipe's RolloutConfig and VLLMConfig (the backend; a colocated engine's
    KV cache or GPU share), `generations` the samples of each prompt generated together (HF generate's cache).
    Logs the table on the main process, then refuses what cannot fit (MemoryPlan.check)."""
    if rollout is not None:
        costs = [len(p) + rollout.max_completion_length for p in costs]  # a sample's tokens at most
    engine = rollout.rollout if rollout is not None else "none"
    kv_cache_gib = vllm.vllm_kv_cache_gib if vllm is not None else 0.0
    gpu_engine_share = vllm.vllm_gpu_memory_utilization if engine == "vllm" and torch.cuda.is_available() else 0.0
    world = accelerator.num_processes
    name = accelerator.sharding.name
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    policy = meta_model(model_path)
    n_policy, config = sum(p.numel() for p in policy.parameters()), policy.config
    sharded = name in ("zero3", "fsdp2")
    lora = getattr(tc, "use_peft", False)
    adapter = adapter_count(policy, tc.lora_r, tc.lora_target_modules) if lora else 0
    trained = [adapter if lora else n_policy] + [parameter_count(p) for p in trained_extra]
    state_div = world if sharded else 1
    per_param = 16 / state_div
    if name in ("zero1", "zero2"):
        per_param = 4 + (4 if name == "zero1" else 4 / world) + 8 / world
    state = sum(trained) * per_param + (n_policy * 4 / state_div if lora else 0)
    frozen_params = [parameter_count(p) for p in frozen]
    frozen_bytes = sum(frozen_params) * 4 / state_div
    bf16 = bool(getattr(tc, "bf16", False))
    terms = {"model state": state / GIB, "frozen models": frozen_bytes / GIB}
    notes = {"model state": f"{sum(trained) / 1e6:.1f}M trained x {per_param:g} B"
                            + (f" + a {n_policy / 1e6:.0f}M frozen base" if lora else "") + f" ({name})",
             "frozen models": f"{sum(frozen_params) / 1e6:.1f}M x {4 / state_div:g} B" if frozen else "none"}

    def per_microbatch(budget: int | None) -> dict:
        """The terms that grow with a micro-batch's tokens, and their notes."""
        tokens = largest_microbatch(costs, tc.per_device_train_batch_size, budget)
        acts = activation_bytes(config, tokens, tc.gradient_checkpointing, bf16)
        tile = 3 * min(tokens, TILE) * min(config.vocab_size, TILE) * 4
        split = f", at most {budget} a micro-batch" if budget else ""
        return {"activations": (acts / GIB, f"{tokens} tokens x {config.num_hidden_layers} layers, "
                                            f"{'with' if tc.gradient_checkpointing else 'no'} gradient "
                                            f"checkpointing{split}"),
                "LM-head tiles": (tile / GIB, f"{min(tokens, TILE)} x {min(config.vocab_size, TILE)} fp32 x 3")}

    for key, (gib, note) in per_microbatch(tc.token_budget).items():
        terms[key], notes[key] = gib, note
    if engine == "hf":
        from verl_kit.rollout.hf import shares_policy

        copy = not shares_policy(accelerator.sharding.whole, lora, bf16, rollout.async_rollout)
        terms["rollout engine"] = n_policy * 4 * copy / GIB
        notes["rollout engine"] = ("HF generate: a copy of the policy" if copy
                                   else "HF generate on the trained model: no copy")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        samples = rollout.prompts_per_step // world * generations
        per_token = 2 * config.num_hidden_layers * getattr(config, "num_key_value_heads", config.num_attention_heads) \
            * head_dim * 4
        terms["KV cache"] = per_token * samples * max(costs, default=0) / GIB
        notes["KV cache"] = (f"HF generate: {samples} samples x {max(costs, default=0)} tokens, during generation "
                             "only (the total counts it or the update's terms, the larger)")
    elif engine == "vllm":
        on_cpu = not torch.cuda.is_available()
        terms["rollout engine"] = ((n_policy * 4 + kv_cache_gib * GIB + ENGINE_PROCESS_BYTES) / GIB) if on_cpu else 0.0
        notes["rollout engine"] = ("colocated vLLM (its own processes): weights, KV cache, its processes" if on_cpu
                                   else "colocated vLLM: its GPU share is taken out of the budget")
        if on_cpu:  # on CUDA both are host memory, outside the device's budget
            terms["rollout client"] = (VLLM_LIBRARY_BYTES + n_policy * 4) / GIB
            notes["rollout client"] = "vLLM's library here, the weight-sync slots in /dev/shm"
    rss = _rss_now()
    terms["this process"] = rss / GIB
    notes["this process"] = "resident now (Python, torch, the libraries)"
    out = MemoryPlan(terms, notes, budget(local, tc.memory_limit_gib, gpu_engine_share), local)
    if tc.max_tokens_per_microbatch == "auto":
        chosen = auto_budget(out, costs, tc, per_microbatch, accelerator)
        for key, (gib, note) in per_microbatch(chosen).items():
            out.terms[key], out.notes[key] = gib, note
        tc.chosen_token_budget = chosen
    if accelerator.is_main_process:
        logger.info(out.table())
    out.check()
    return out


def auto_budget(plan: MemoryPlan, costs: list[int], tc, per_microbatch, accelerator) -> int | None:
    """--max_tokens_per_microbatch auto: None (micro-batches of --per_device_train_batch_size items, as with a number
    unset) where the plan fits --memory_fraction of the run's memory; otherwise the largest token budget whose
    micro-batch terms fit beside the others, bisected over budgets from the longest item to the unsplit micro-batch
    (never below one item: a run that does not fit then is refused by MemoryPlan.check). The same on every process
    (the smallest of theirs: their resident sizes differ a little)."""
    from verl_kit.train.distributed import all_reduce_max

    room = tc.memory_fraction * plan.budget.limit

    def fits(b: int) -> bool:  # the plan's total with micro-batches of at most b tokens
        terms = {**plan.terms, **{k: gib for k, (gib, _) in per_microbatch(b).items()}}
        return replace(plan, terms=terms).total <= room

    chosen = None
    if plan.total > room and costs:
        lo, hi = max(costs), largest_microbatch(costs, tc.per_device_train_batch_size, None)
        if lo < hi and fits(lo):
            while hi - lo > 1:  # lo fits, hi does not
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            chosen = lo
    agreed = -all_reduce_max(-float(chosen if chosen is not None else "inf"))
    chosen = None if agreed == float("inf") else int(agreed)
    if chosen is not None and accelerator.is_main_process:
        logger.info("memory plan: micro-batches of at most %d tokens (--max_tokens_per_microbatch auto: unsplit, the "
                    "plan's %.2f GiB exceeds --memory_fraction %.2f of %.2f GiB)", chosen, plan.total,
                    tc.memory_fraction, plan.budget.limit)
    return chosen


def _rss_now() -> int:
    statm = (_read("/proc/self/statm") or "0 0").split()
    return int(statm[1]) * os.sysconf("SC_PAGE_SIZE")
