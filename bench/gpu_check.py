"""The device check (`make gpu-check`): what a GPU run of each recipe's GPU config costs, on a random-init model of a
real shape, in the few minutes a lent device gives.

For each recipes/configs/*_gpu.yaml, Qwen2.5-0.5B's architecture (written out below, built on the device: no
download) trains a few steps in bf16 autocast over fp32 weights (what accelerate's mixed_precision bf16 does without
DeepSpeed) on random token sequences laid out as that config lays them out (its max_length, batch size, packing
length, gradient checkpointing), with the recipe's loss from verl_kit.algos: DPO's pair loss against a frozen
reference, GRPO's clipped surrogate on group advantages, PPO's surrogate plus a critic's clipped value loss. It prints
and records tokens/s, MFU (6 * parameters * tokens / s over the device's peak dense bf16 FLOP/s, from the table
below by device name; the recompute of gradient checkpointing is not counted) and peak memory. Then two equalities
on the device: packed rows (block mask, or flash-attention varlen when flash_attn is installed) score each sequence
as padded rows do, in fp32 and in bf16; ZeRO-3 against one process needs DeepSpeed and a multi-process launch and is
skipped with a line saying so, as are vLLM rollouts (generation is not timed; the image has no vLLM).

Imports only torch, transformers, accelerate-free kit modules (verl_kit.algos, verl_kit.data.packing: torch only) and
yaml (a transformers dependency): the GPU image has no deepspeed, trl, datasets, ray or vllm.

    make gpu-check                     # python bench/gpu_check.py; summary to $OUT/gpu_check.json (or ./gpu_check.json)
    GPU_CHECK_DRY_RUN=1 python bench/gpu_check.py   # same code, tiny shapes, CPU or GPU, a few seconds
    GPU_CHECK_TIMEOUT_S=480 (default): each phase checks the clock; the summary is written after each phase and the
    script exits 0 with "stopped: timeout" in it when time runs out (a hard alarm 30 s later exits 3).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verl_kit.algos import clipped_surrogate, dpo_loss, group_advantages, value_loss  # noqa: E402
from verl_kit.data.packing import layout, logprobs_from_logits, split_by_tokens  # noqa: E402

DRY = os.environ.get("GPU_CHECK_DRY_RUN", "0") == "1"
TIMEOUT_S = float(os.environ.get("GPU_CHECK_TIMEOUT_S", "60" if DRY else "480"))
STEPS = int(os.environ.get("GPU_CHECK_STEPS", "1" if DRY else "4"))  # timed steps after one warm-up step

# Qwen/Qwen2.5-0.5B-Instruct's config.json (the policy of grpo_gpu.yaml and ppo_gpu.yaml), written out.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, attention_dropout=0.0)
TINY = dict(QWEN25_05B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

# Peak dense bf16 FLOP/s (no sparsity) by a substring of torch.cuda.get_device_name(), most specific first.
PEAK_BF16 = [("GB200", 2.5e15), ("B200", 2.25e15), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
             ("H800", 989e12), ("H20", 148e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12),
             ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 6000 Ada", 364e12),
             ("A6000", 155e12), ("V100", 125e12), ("MI300X", 1307e12), ("MI250", 362e12)]


def peak_flops(name: str) -> float | None:
    return next((f for key, f in PEAK_BF16 if key in name), None)


class Timeout(Exception):
    pass


class Check:
    """The run's clock and its summary file (rewritten after each phase, so a timeout keeps what was measured)."""

    def __init__(self):
        self.t0 = time.time()
        self.path = Path(os.environ.get("OUT") or ".") / "gpu_check.json"
        self.summary: dict = {"dry_run": DRY, "timeout_s": TIMEOUT_S, "steps": STEPS, "recipes": {}, "equalities": {},
                              "skipped": [], "stopped": None}

    def left(self) -> float:
        return TIMEOUT_S - (time.time() - self.t0)

    def tick(self):
        if self.left() <= 0:
            raise Timeout

    def skip(self, what: str, why: str):
        line = f"skipped: {what}: {why}"
        print(line, flush=True)
        self.summary["skipped"].append(line)

    def write(self):
        self.summary["elapsed_s"] = round(time.time() - self.t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary, indent=1) + "\n")


def read_config(path: Path) -> dict:
    import yaml

    cfg = yaml.safe_load(path.read_text())
    if DRY:  # same fields, tiny sizes
        cfg = dict(cfg, max_length=64, max_prompt_length=24, max_completion_length=40, per_device_train_batch_size=4,
                   packing_length=128, max_tokens_per_microbatch=256, num_generations=2)
    return cfg


def build_model(device, critic: bool = False, initializer_range: float = 0.02):
    """Random init on the device from the written-out config: a causal LM, or (critic) the backbone with a scalar
    head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    config = Qwen2Config(**(TINY if DRY else QWEN25_05B), initializer_range=initializer_range)
    config.use_cache = False
    attn = "flash_attention_2" if device.type == "cuda" and _has("flash_attn") else "sdpa"
    config._attn_implementation = attn
    with torch.device(device):
        torch.manual_seed(0)
        if critic:
            model = Qwen2Model(config)
            model.value_head = torch.nn.Linear(config.hidden_size, 1)
        else:
            model = Qwen2ForCausalLM(config)
    return model.float(), attn


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install counts as none
        return False


def autocast(device, bf16: bool = True):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def random_sequences(g: torch.Generator, n: int, prompt_len: int, max_len: int, vocab: int):
    """n (ids, loss_mask) of random lengths in [max_len / 2, max_len]: a prompt then a scored completion."""
    seqs, masks = [], []
    for _ in range(n):
        total = int(torch.randint(max_len // 2, max_len + 1, (1,), generator=g))
        p = min(prompt_len, total - 2)
        seqs.append(torch.randint(3, vocab, (total,), generator=g).tolist())
        masks.append([False] * p + [True] * (total - p))
    return seqs, masks


def batch_for(cfg: dict, seqs, masks, attn: str, device):
    packing = bool(cfg.get("packing", True))
    flash = attn == "flash_attention_2"
    return layout(seqs, masks, pad_id=0, packing=packing, packing_length=cfg.get("packing_length"),
                  block_mask=not flash).to(device)


def seq_logps(model, batch, device):
    with autocast(device):
        logits = model(**batch.inputs()).logits
    return token_logprobs(logits, batch)


def token_logprobs(logits, batch):
    """The whole-logits path (this script runs without TRL, whose kernels verl_kit.train.lm_head uses)."""
    scored = batch.scored
    return logprobs_from_logits(logits[:, :-1][scored], batch.input_ids[:, 1:][scored]), batch.seq_ids[:, 1:][scored]


def run_recipe(check: Check, name: str, cfg: dict, device) -> dict:
    """A few optimizer steps of `name`'s loss under `cfg`'s shapes; returns its figures."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, attn = build_model(device)
    models = [model]
    critic = None
    if name == "ppo":
        critic, _ = build_model(device, critic=True)
        models.append(critic)
    if cfg.get("gradient_checkpointing"):
        for m in models:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for m in models for p in m.parameters()]
    n_params = sum(p.numel() for p in {id(p): p for p in params}.values())
    opt = torch.optim.AdamW(params, lr=float(cfg.get("learning_rate", 1e-6)), fused=device.type == "cuda")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    max_len = int(cfg["max_length"])
    prompt_len = int(cfg.get("max_prompt_length", max_len // 2))
    rows = int(cfg["per_device_train_batch_size"])
    if name == "dpo":
        rows *= 2  # chosen and rejected of each pair
    if name == "grpo":  # whole groups
        rows = max(int(cfg.get("num_generations", 2)), rows - rows % int(cfg.get("num_generations", 2)))
    tokens_done, seconds = 0, 0.0
    unit = 2 if name == "dpo" else 1  # a DPO pair (chosen, rejected) stays in one micro-batch
    budget = int(cfg.get("max_tokens_per_microbatch") or 10**9)
    micro_batches = 0
    for step in range(STEPS + 1):  # step 0 warms up (kernels, allocator) and is not timed
        check.tick()
        seqs, masks = random_sequences(g, rows, prompt_len, max_len, vocab)
        scores = torch.rand(rows, generator=g)
        group = int(cfg.get("num_generations", 1))
        adv = group_advantages(scores, group) if group > 1 else scores - scores.mean()
        units = [list(range(i, i + unit)) for i in range(0, rows, unit)]
        chunks = [[i for u in c for i in units[u]]  # the recipes' token budget per micro-batch
                  for c in split_by_tokens([sum(len(seqs[i]) for i in u) for u in units], budget)]
        refs = []
        if name == "dpo":  # the frozen reference's log-probs, before the timer (the recipe precomputes them too)
            with torch.no_grad():
                for c in chunks:
                    batch = batch_for(cfg, [seqs[i] for i in c], [masks[i] for i in c], attn, device)
                    ref, index = seq_logps(model, batch, device)
                    refs.append(torch.zeros(batch.num_seqs, device=device).index_add(0, index, ref))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        total = 0.0
        for k, c in enumerate(chunks):
            batch = batch_for(cfg, [seqs[i] for i in c], [masks[i] for i in c], attn, device)
            logps, index = seq_logps(model, batch, device)
            if name == "dpo":
                pol = torch.zeros(batch.num_seqs, device=device).index_add(0, index, logps)
                loss = dpo_loss(pol[0::2], pol[1::2], refs[k][0::2], refs[k][1::2], float(cfg.get("beta", 0.1))).sum()
                loss = loss / (rows // 2)
            else:
                a, sc = adv[c].to(device), scores[c].to(device)
                loss = clipped_surrogate(logps, logps - logps.detach(), a[index], 0.2).loss.sum()
                if critic is not None:
                    with autocast(device):
                        hidden = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                        position_ids=batch.position_ids).last_hidden_state
                        values = critic.value_head(hidden).squeeze(-1).float()[:, :-1][batch.scored]
                    loss = loss + value_loss(values, values.detach(), sc[index], 0.2).loss.sum()
                loss = loss / sum(sum(masks[i]) for i in range(rows))  # token mean over the step
            loss.backward()
            total += loss.item()
            if step > 0:
                tokens_done += batch.num_tokens
        micro_batches = len(chunks)
        torch.nn.utils.clip_grad_norm_(params, float(cfg.get("max_grad_norm", 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            seconds += time.time() - t
        if not math.isfinite(total):
            raise RuntimeError(f"{name}: loss {total} at step {step}")
    tps = tokens_done / seconds
    peak = peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    out = {"attn_implementation": attn, "params": n_params, "rows_per_step": rows, "timed_steps": STEPS,
           "micro_batches": micro_batches, "tokens_per_s": round(tps, 1), "step_s": round(seconds / STEPS, 4),
           "loss": total,
           "mfu": None if peak is None else round(6 * n_params * tps / peak, 4),
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
           "gradient_checkpointing": bool(cfg.get("gradient_checkpointing")), "packing": bool(cfg.get("packing", True)),
           "packing_length": cfg.get("packing_length")}
    del model, critic, opt, models, params
    return out


@torch.no_grad()
def packed_vs_padded(device) -> dict:
    """Per-token log-probs of the same sequences in packed rows (block mask, or varlen under flash-attention) and in
    padded rows: max |difference| in fp32 (the equality, < 1e-3; flash-attention has no fp32, so there bf16 only) and
    in bf16 autocast (reported, not judged: each layout rounds its activations differently). Initialised 10x wider
    than training does, so the log-probs spread like a trained model's or more (std 1.6 on the tiny shape, 6.5 on
    Qwen2.5-0.5B's, where CPU measured fp32 7e-5; at 0.02 they are near uniform and hide errors). Under sdpa, packed
    rows without their mask are scored too: they must differ, or the check is blind."""
    model, attn = build_model(device, initializer_range=0.2)
    model.eval()
    flash = attn == "flash_attention_2"
    g = torch.Generator().manual_seed(1)
    seqs, masks = random_sequences(g, 8, 8, 48 if DRY else 512, model.config.vocab_size)
    out = {"attn_implementation": attn}
    for bf16 in (True,) if flash else (False, True):
        got = []
        for packing in (False, True):
            batch = layout(seqs, masks, pad_id=0, packing=packing, packing_length=4 * (48 if DRY else 512),
                           block_mask=not flash).to(device)
            with autocast(device, bf16):
                logps, index = token_logprobs(model(**batch.inputs()).logits, batch)
            got.append(logps[torch.argsort(index, stable=True)])
        out["bf16" if bf16 else "fp32"] = float((got[0] - got[1]).abs().max())
        if not bf16:  # the negative control: packed rows, no block mask and positions running on
            batch.attention_mask = None
            batch.position_ids = torch.arange(batch.input_ids.shape[1], device=device).expand_as(batch.input_ids)
            logps, index = token_logprobs(model(**batch.inputs()).logits, batch)
            out["fp32_packed_without_mask"] = float((got[0] - logps[torch.argsort(index, stable=True)]).abs().max())
            out["logprob_std"] = float(got[0].std())
    out["ok"] = None if flash else out["fp32"] < 1e-3 and out["fp32_packed_without_mask"] > 1e-2
    return out


def main() -> int:
    check = Check()

    def alarm(*_):
        check.summary["stopped"] = "hard timeout"
        check.write()
        os._exit(3)

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(TIMEOUT_S) + 30)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    check.summary.update(device=name, torch=torch.__version__, peak_bf16_flops=peak_flops(name)
                         if device.type == "cuda" else None, model="tiny (dry run)" if DRY else "Qwen2.5-0.5B shape")
    print(f"gpu-check on {name} (torch {torch.__version__}){' DRY RUN' if DRY else ''}: {STEPS} timed steps per "
          f"recipe, timeout {TIMEOUT_S:.0f}s", flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 equality below is about layouts, not TF32
    for what, module in (("vLLM rollouts (generation not timed)", "vllm"),
                         ("ZeRO-3 vs one process", "deepspeed")):
        if not _has(module):
            check.skip(what, f"{module} is not installed in this image")
        elif what.startswith("ZeRO-3"):
            check.skip(what, "needs an accelerate launch of several processes (tests/ run it on CPU)")
        else:
            check.skip(what, "this check times training only")
    if not _has("flash_attn"):
        print("note: flash_attn not installed: packed rows use the block-diagonal mask under sdpa", flush=True)
    try:
        for path in sorted((REPO / "recipes" / "configs").glob("*_gpu.yaml")):
            recipe = path.name.removesuffix("_gpu.yaml")
            if recipe not in ("dpo", "grpo", "ppo"):
                check.skip(path.name, "no loss for this recipe in the check")
                continue
            try:
                figures = run_recipe(check, recipe, read_config(path), device)
            except Timeout:
                raise
            except Exception as e:  # noqa: BLE001 (one recipe's failure, e.g. out of memory, is a figure too)
                check.summary["recipes"][recipe] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                print(f"{path.name}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                check.write()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            check.summary["recipes"][recipe] = figures
            mfu = "n/a" if figures["mfu"] is None else f"{100 * figures['mfu']:.1f}%"
            mem = "n/a" if figures["peak_memory_gib"] is None else f"{figures['peak_memory_gib']} GiB"
            print(f"{path.name}: {figures['tokens_per_s']:.0f} tokens/s, MFU {mfu}, peak memory {mem}, "
                  f"{figures['params'] / 1e6:.1f}M params, attention {figures['attn_implementation']}", flush=True)
            check.write()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        check.tick()
        eq = packed_vs_padded(device)
        check.summary["equalities"]["packed_vs_padded"] = eq
        verdict = {True: "ok", False: "FAIL", None: "not judged: no fp32 under flash-attention"}[eq["ok"]]
        print(f"packed vs padded: max |token logprob diff| fp32 {eq.get('fp32', float('nan')):.3g} (without the mask "
              f"{eq.get('fp32_packed_without_mask', float('nan')):.3g}), bf16 {eq['bf16']:.3g}: {verdict}", flush=True)
    except Timeout:
        check.summary["stopped"] = "timeout"
        print(f"stopped: timeout after {TIMEOUT_S:.0f}s; the summary holds what was measured", flush=True)
    signal.alarm(0)
    check.write()
    print(f"summary: {check.path}", flush=True)
    eq = check.summary["equalities"].get("packed_vs_padded")
    failed = any("error" in r for r in check.summary["recipes"].values())
    return 1 if failed or eq is not None and eq["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
