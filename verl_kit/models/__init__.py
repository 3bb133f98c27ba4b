"""Model loading and export, the attention that packed rows run with (packed_attention), LoRA through peft, ZeRO-3
context managers, FSDP2 sharding (models.fsdp2), the embedded tiny model and the packaged real model (smollm2-135m)."""

from verl_kit.models.loading import (
    cache_dir,
    chat_template_kwargs,
    check_shared_tokenizer,
    default_attn_implementation,
    export_hf,
    load_causal_lm,
    load_policy,
    load_tokenizer,
    quantized,
    resolve_attn_implementation,
    resolve_model_path,
    training_template,
    uses_block_mask,
    without_dropout,
)
from verl_kit.models.lora import (
    ADAPTER,
    adapter_params,
    base_name,
    check_flags,
    export_adapter,
    is_adapter_param,
    linear_module_names,
    lora_layers,
    merged_weight,
    peft_model,
    reference,
    tied_embedding_targets,
    with_lora,
)
from verl_kit.models.real_model import (
    SMOLLM2_DIR_NAME,
    SMOLLM2_GGUF,
    SMOLLM2_NAME,
    check_gguf,
    convert_smollm2,
    smollm2_gguf_path,
)
from verl_kit.models.tiny import (
    ASKS,
    ASSETS,
    BAD,
    CHAT_TEMPLATE,
    CLOSERS,
    GOOD,
    OPENERS,
    SPECIAL_TOKENS,
    TINY_MODEL_NAME,
    TINY_PREFS,
    TOPICS,
    build_tiny_model,
    build_tokenizer,
    make_preference_rows,
    write_preference_data,
)
from verl_kit.models.zero3 import gathered_params, outside_zero3
