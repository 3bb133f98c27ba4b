"""LoRA through peft, for every recipe (`--use_peft`, TRL ModelConfig's flag names): the one place that knows a model
may carry an adapter.

with_lora(model, cfg)    the model with a fresh LoRA adapter (peft's get_peft_model), or the model itself
reference(model)         the base model inside a LoRA policy: the same module called with its adapter disabled, so the
                         reference costs no second copy of the weights (PPO/GRPO reference log-probs)
merged_weight(...)       an adapted layer's weight merged (W + scale * B @ A, peft's get_delta_weight): the weight
                         sync (weight_sync.gathered_buckets) sends the policy as a plain HF model names it, adapter
                         weights left out, so the engine gets exactly the trained policy as full weights
tied_embedding_targets   target modules that name a tied output layer / embedding: refused (a merged adapter there
                         would change both in rollouts and exports)
export_adapter(...)      `final/` = the adapter (PeftModel.from_pretrained loads it), `final/merged` = a full HF model

Under ZeRO-3 the frozen base weights stay partitioned like any parameter (1/world per process); only the adapter
weights have gradients and AdamW state, so the optimizer partitions those only (measured in bench/lora_vs_full.py).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from verl_kit.errors import UserError
from verl_kit.models.zero3 import outside_zero3

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's name for the one adapter a model gets here


def check_flags(cfg, defaults) -> None:
    """LoRA flags only mean something with --use_peft: one line naming the first one set without it. 4-bit base
    weights need a GPU: bitsandbytes 0.50.2 does load and train NF4 layers on CPU, but after the first forward in
    eval mode without gradients (every probe, reference and evaluation pass here) a layer repacks its weight for a
    CPU kernel that has no backward, and the LoRA gradients come out wrong with only a warning (measured: up to 66%
    relative error on the tiny model; loss on SmolLM2 14.54 -> 14.39 instead of -> 12.75)."""
    if getattr(cfg, "use_peft", False):
        if cfg.lora_r < 1 or cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
            raise UserError(f"--lora_r {cfg.lora_r} / --lora_alpha {cfg.lora_alpha} / --lora_dropout "
                            f"{cfg.lora_dropout}: need r >= 1, alpha > 0 and 0 <= dropout < 1")
        if getattr(cfg, "load_in_4bit", False) and not torch.cuda.is_available():
            raise UserError("--load_in_4bit needs a GPU: bitsandbytes' CPU 4-bit kernel gives wrong LoRA gradients "
                            "after a no-grad forward (see verl_kit/models/lora.py); drop the flag to train LoRA on CPU")
        return
    for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit"):
        if hasattr(cfg, name) and getattr(cfg, name) != getattr(defaults, name):
            raise UserError(f"--{name} is a LoRA flag: add --use_peft (or drop --{name})")


def _targets(spec: str | None) -> str | list[str]:
    if spec is None or spec.strip() in ("", "all-linear"):
        return "all-linear"
    return [s.strip() for s in spec.split(",") if s.strip()]


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora_target_modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def tied_embedding_targets(model: nn.Module, targets: str | list[str]) -> list[str]:
    """The targets that name the output layer or the input embedding of a model where the two share one weight
    (SmolLM2, Qwen2.5 small, Llama-3.2 1B/3B). Adapting such a layer cannot be synced as a merged tensor: the weight
    sync and the export send one merged tensor under the embedding's name with the output layer as an alias, so the
    engine's embedding changes too (measured on the tied tiny model with lm_head adapted: synced copy vs trainer
    1.75 nats). peft only warns. `all-linear` never matches the output layer."""
    if isinstance(targets, str):
        return []
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    inp, out = (get_in() if get_in else None), (get_out() if get_out else None)
    if inp is None or out is None or getattr(out, "weight", None) is not getattr(inp, "weight", None):
        return []
    names = [n for n, m in model.named_modules() if m is inp or m is out]
    return [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]


def with_lora(model: nn.Module, cfg, task_type: str | None = "CAUSAL_LM") -> nn.Module:
    """`model` with a new LoRA adapter (r, alpha, dropout, target modules from cfg) when `--use_peft`, else `model`.
    The task type follows from the model, so it is no flag: CAUSAL_LM for a policy, SEQ_CLS for a reward model
    (peft keeps its `score` head fully trainable, modules_to_save), None for a bare backbone (the PPO critic's)."""
    if not cfg.use_peft:
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(cfg, "load_in_4bit", False):  # QLoRA (GPU only; not run in CI; ZeRO-3 refuses it: train/sharding.py)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})

    targets = _targets(cfg.lora_target_modules)
    tied = tied_embedding_targets(model, targets)
    if tied:
        raise UserError(f"--lora_target_modules {cfg.lora_target_modules}: this model's output layer and input "
                        f"embedding share one weight (tied embeddings), so a merged adapter on {', '.join(tied)} "
                        f"would change both in rollouts and exports; leave {', '.join(tied)} out")
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets, bias="none", task_type=task_type)
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        if "not found in the base model" not in str(e):
            raise
        raise UserError(f"--lora_target_modules {cfg.lora_target_modules}: matches no module of the model; its "
                        f"linear layers are {', '.join(linear_module_names(model))}") from None


def peft_model(model: nn.Module):
    """The PeftModel in `model` (itself, inside a DDP/DeepSpeed wrapper, or the classifier inside the reward model
    recipe's TokenRewardModel), or None without an adapter."""
    return next((m for _, m in _peft_modules(model)), None)


def _peft_modules(model: nn.Module):
    from peft import PeftModel

    return ((name, m) for name, m in getattr(model, "module", model).named_modules() if isinstance(m, PeftModel))


class _WithoutAdapter(nn.Module):
    """Calls a LoRA policy with its adapter disabled: the base model, i.e. the initial policy."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with peft_model(self.model).disable_adapter():
            return self.model(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return peft_model(self.model).get_output_embeddings()

    @property
    def config(self):
        return peft_model(self.model).config


def reference(model: nn.Module) -> nn.Module:
    """The reference model of a LoRA policy (placed: the DeepSpeed/DDP engine or module): the same weights with the
    adapter disabled. Every process calls it the same number of times (ZeRO-3 gathers shards in forward)."""
    return _WithoutAdapter(model)


def base_name(name: str) -> str:
    """peft's name of a wrapped layer's own weight -> the plain model's name ('q_proj.base_layer.weight' ->
    'q_proj.weight')."""
    return name.replace(".base_layer.", ".")


def is_adapter_param(name: str) -> bool:
    return ".lora_" in name or ".modules_to_save." in name or ".original_module." in name


def lora_layers(model: nn.Module) -> dict[int, nn.Module]:
    """{id(base weight): its LoRA layer} for every LoRA-wrapped layer of a peft model (empty for a plain model)."""
    from peft.tuners.lora import LoraLayer

    return {id(m.get_base_layer().weight): m for m in model.modules()
            if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def merged_weight(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """W + scale * B @ A of a LoRA layer whose parameters are gathered (peft's own delta, in W's dtype)."""
    return weight + layer.get_delta_weight(ADAPTER).to(weight.dtype)


# The linear layers vLLM's LoRA serves in the decoders the kit trains (Llama-style names: SmolLM2, Qwen, Llama, Mistral)
VLLM_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def vllm_unservable(model: nn.Module) -> str | None:
    """None when a vLLM engine can serve `model`'s adapter as it is (the adapter-only weight sync), else why not, in
    a phrase: no adapter; whole modules trained beside it (modules_to_save); DoRA or rsLoRA; a layer vLLM's LoRA does
    not serve; a rank above vLLM's largest (512)."""
    peft = peft_model(model)
    if peft is None:
        return "no adapter"
    cfg = peft.peft_config[ADAPTER]
    if cfg.modules_to_save:
        return f"the adapter trains whole modules too ({', '.join(sorted(cfg.modules_to_save))})"
    if getattr(cfg, "use_dora", False) or getattr(cfg, "use_rslora", False):
        return "DoRA / rsLoRA adapters"
    from peft.tuners.lora import LoraLayer

    adapted = {n.rsplit(".", 1)[-1] for n, m in peft.named_modules() if isinstance(m, LoraLayer)}
    unserved = sorted(adapted - VLLM_LORA_MODULES)
    if unserved:
        return f"vLLM's LoRA does not serve {', '.join(unserved)}"
    if cfg.r > 512:
        return f"rank {cfg.r} > 512"
    return None


def adapter_params(layer: nn.Module) -> list[nn.Parameter]:
    return [layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight]


def export_adapter(unwrapped, state_dict: dict, tokenizer, tmp: str) -> None:
    """Main process, after the gather (`state_dict`: the full state of `unwrapped`): the adapter into `tmp`
    (adapter_config.json + adapter_model.safetensors, with a reward model's trained score head), then `tmp/merged`:
    the base weights of `state_dict` in a plain model, the adapter loaded from `tmp` and merged by peft (so the
    export is what PeftModel.from_pretrained reads)."""
    from peft import PeftModel

    name, peft = next(_peft_modules(unwrapped))
    prefix = f"{name}." if name else ""
    state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    peft.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    hf = peft.get_base_model()
    if getattr(hf, "is_quantized", False):
        logger.warning("4-bit base: no final/merged (merge the adapter onto the full-precision base instead)")
        return
    with outside_zero3():  # on this process only: not partitioned
        plain = type(hf)(hf.config).float()
    base = {base_name(k).removeprefix("base_model.model."): v for k, v in state_dict.items() if not is_adapter_param(k)}
    missing = plain.load_state_dict(base, strict=False).missing_keys
    heads = {f"{m}.weight" for m in peft.peft_config[ADAPTER].modules_to_save or ()} | \
        {f"{m}.bias" for m in peft.peft_config[ADAPTER].modules_to_save or ()}
    tied = {"lm_head.weight"} if getattr(hf.config, "tie_word_embeddings", False) else set()
    if set(missing) - heads - tied:
        raise RuntimeError(f"LoRA export: base weights missing from the gathered state: {sorted(missing)[:5]}")
    merged = PeftModel.from_pretrained(plain, tmp).merge_and_unload()
    merged.save_pretrained(os.path.join(tmp, "merged"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(tmp, "merged"))
