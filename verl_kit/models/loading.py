"""Loading causal LMs and tokenizers, gradient checkpointing, and the HF export of a trained model (gathered from
ZeRO-3 shards). Under ZeRO-3 with `zero3_init_flag`, from_pretrained loads straight into shards because the
Accelerator, built first, has registered its DeepSpeed config with transformers."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil

import torch

from verl_kit.durable import replace_dir, write_failure
from verl_kit.errors import UserError
from verl_kit.models import fsdp2
from verl_kit.models.lora import export_adapter, peft_model, with_lora
from verl_kit.models.packed_attention import SEGMENT_ATTENTION, implementation
from verl_kit.models.real_model import SMOLLM2_DIR_NAME, SMOLLM2_NAME, check_gguf, smollm2_gguf_path
from verl_kit.models.tiny import TINY_MODEL_NAME

logger = logging.getLogger(__name__)


def cache_dir() -> str:
    return os.environ.get("VERL_KIT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "verl_kit"))


def resolve_model_path(name: str) -> str:
    """'tiny-llama' -> the embedded model, built offline into the cache on first use; 'smollm2-135m' -> SmolLM2-135M-
    Instruct, converted into the cache on first use from the GGUF `make install` fetched; otherwise `name` unchanged
    after checking that a local path exists or the name can be found by transformers."""
    if name == TINY_MODEL_NAME:
        path = os.path.join(cache_dir(), "tiny-llama-v1")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            logger.info("building the embedded tiny model in %s", path)
            _build_outside_distributed(["tiny", path])
        return path
    if name == SMOLLM2_NAME:
        path = os.path.join(cache_dir(), SMOLLM2_DIR_NAME)
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            check_gguf()
            logger.info("converting %s into %s", smollm2_gguf_path(), path)
            _build_outside_distributed(["smollm2", path])
        return path
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UserError(f"--model_name_or_path {name}: directory has no config.json")
        return name
    if name.startswith(("/", ".", "~")):
        raise UserError(f"--model_name_or_path {name}: no such directory")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise UserError(f"--model_name_or_path {name}: not found as a local directory ({os.path.abspath(name)}) "
                        f"nor in the Hugging Face cache/hub ({str(e).splitlines()[0]})") from None
    return name


def _build_outside_distributed(args: list[str]) -> None:
    """Build a model (`python -m verl_kit.models tiny|smollm2 PATH`, models/__main__.py) in a child process that
    knows nothing of the launch: inside a distributed run transformers' save_pretrained writes weights on rank 0 only,
    so a rank-1 build would be incomplete. Concurrent builds are safe (each writes a temporary directory; the first
    rename wins)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("ACCELERATE_")}
    subprocess.run([sys.executable, "-m", "verl_kit.models", *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)


def default_attn_implementation() -> str:
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def resolve_attn_implementation(name: str | None) -> str:
    """The attn_implementation the kit loads a model with for --attn_implementation `name` (None: the default):
    "sdpa" becomes the kit's segment attention (models.packed_attention: "sdpa" but for packed rows, whose memory then
    grows with their sequences, not as L^2 per row); the others are transformers' own."""
    return implementation(name or default_attn_implementation())


@contextlib.contextmanager
def quiet_load():
    """transformers' load report off for the block (errors still shown): loading an LM checkpoint into another head
    (a backbone, a sequence classifier) lists the dropped lm_head and the new head as if something were wrong."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def load_tokenizer(path: str, chat_template_kwargs: dict | None = None, multi_turn: bool = False):
    """The tokenizer at `path` (pad = EOS where it has no pad token). `chat_template_kwargs` (--chat_template_kwargs,
    e.g. {"enable_thinking": False}) become defaults of this tokenizer's apply_chat_template, so that every rendering
    of the run sees them, the kit's (prompts, episodes, SFT data, evaluation) and TRL's (preference data) alike; a
    call that passes one of them itself wins. `multi_turn` (a run with episodes): TRL's training version of the
    chat template where it has one (training_template) becomes the default template the same way. Neither is saved
    with the tokenizer: an export keeps the model's own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    defaults = dict(chat_template_kwargs or {})
    if multi_turn and (template := training_template(tokenizer)) is not None:
        logger.info("%s: multi-turn episodes render with TRL's prefix-preserving training version of its chat "
                    "template", path)
        defaults["chat_template"] = template
    if defaults:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **defaults)
    return tokenizer


def training_template(tokenizer) -> str | None:
    """TRL 1.16's training version of the tokenizer's chat template (trl/chat_templates/*_training.jinja: it renders
    a conversation so that each turn's text stays as it was when later turns are added, e.g. Qwen3 keeps earlier
    reasoning, and marks the assistant's tokens), or None where the template needs none or TRL has none for it;
    an unknown template that does not extend a conversation by appending is then refused by the episodes' check
    (rollout.chat.check_prefix_property)."""
    from trl.chat_template_utils import get_training_chat_template

    try:
        return get_training_chat_template(tokenizer)
    except ValueError:  # TRL has no training version of this template
        return None


def chat_template_kwargs(tokenizer) -> dict:
    """The --chat_template_kwargs a tokenizer was loaded with ({} for none)."""
    apply = tokenizer.apply_chat_template
    return dict(apply.keywords) if isinstance(apply, functools.partial) else {}


def check_shared_tokenizer(student, teacher, teacher_flag: str) -> None:
    """Distillation scores the student's token ids with the teacher: both tokenizers must map the same strings to the
    same ids, with the same special tokens and chat template ids. A one-line UserError naming `teacher_flag` (the
    flag and its value) otherwise."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    why = None
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()))[:1]
        why = f"the vocabularies differ ({len(sv)} vs {len(tv)} tokens; first difference: {diff[0][0]!r})"
    elif (student.eos_token_id, student.bos_token_id) != (teacher.eos_token_id, teacher.bos_token_id):
        why = (f"the special tokens differ (eos/bos ids {student.eos_token_id}/{student.bos_token_id} vs "
               f"{teacher.eos_token_id}/{teacher.bos_token_id})")
    elif bool(student.chat_template) != bool(teacher.chat_template):
        why = "one has a chat template and the other none"
    elif student.chat_template:
        probe = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
        ids = [t(t.apply_chat_template(probe, tokenize=False), add_special_tokens=False)["input_ids"]
               for t in (student, teacher)]
        if ids[0] != ids[1]:
            why = "the chat templates give a conversation different token ids"
    if why:
        raise UserError(f"{teacher_flag}: the teacher's tokenizer is not the student's: {why}; teacher and student "
                        "must share vocabulary, special tokens and chat template")


def load_policy(path: str, cfg) -> torch.nn.Module:
    """The policy a recipe trains, as its config.ModelConfig asks: the causal LM at `path` with --attn_implementation,
    --gradient_checkpointing and (OfflineConfig) --load_in_4bit, and a new LoRA adapter when --use_peft."""
    return with_lora(load_causal_lm(path, cfg.attn_implementation, cfg.gradient_checkpointing,
                                    getattr(cfg, "load_in_4bit", False)), cfg)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every dropout off (nn.Dropout, LoRA's included, to p=0; attention modules' attention_dropout to
    0), returned: the online recipes' policy and critic. Their ratios compare log-probs of two forwards of one
    function (old and new policy, engine and trainer), which dropout would make two random functions; they train in
    training mode only so that gradient checkpointing runs (transformers checkpoints in training mode alone). TRL's
    disable_dropout, always on here, as in verl."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def load_causal_lm(path: str, attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                   load_in_4bit: bool = False):
    """fp32 weights (DeepSpeed/autocast handle bf16 on GPU); gradient checkpointing without reentrancy.
    `load_in_4bit`: NF4 base weights for QLoRA (verl_kit.models.lora; GPU only)."""
    from transformers import AutoModelForCausalLM

    model = pretrained(AutoModelForCausalLM, path, dtype=torch.float32,
                       attn_implementation=resolve_attn_implementation(attn_implementation), **quantized(load_in_4bit))
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def pretrained(auto_class, path: str, num_labels: int | None = None, **kwargs):
    """`auto_class.from_pretrained(path, ...)`, except where `fsdp2.builds_empty()` (fsdp_cpu_ram_efficient_loading,
    a process other than rank 0): there the same model is built from its config on the meta device, without reading
    the checkpoint, and `fsdp2.shard` broadcasts rank 0's weights into its shards. Every model the kit loads to train
    or to shard comes through here."""
    from transformers import AutoConfig

    labels = {} if num_labels is None else {"num_labels": num_labels}
    if fsdp2.builds_empty() and "quantization_config" not in kwargs:
        with torch.device("meta"):
            return auto_class.from_config(AutoConfig.from_pretrained(path, **labels), **kwargs)
    return auto_class.from_pretrained(path, **labels, **kwargs)


def quantized(load_in_4bit: bool) -> dict:
    """from_pretrained kwargs for QLoRA's 4-bit NF4 base weights (bf16 compute and storage, so ZeRO-2/DDP see one
    dtype); nothing without the flag."""
    if not load_in_4bit:
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16),
        "device_map": {"": torch.cuda.current_device()}}


def uses_block_mask(model) -> bool:
    """Whether packed rows for `model` carry their Segments (layout's `block_mask`): for the kit's segment attention.
    Other implementations read the sequences from the position ids (flash-attention's varlen path; "sdpa" or "eager"
    get a dense block mask that transformers builds from them)."""
    return getattr(model.config, "_attn_implementation", None) == SEGMENT_ATTENTION


def export_hf(accelerator, model, state_dict: dict, tokenizer, out_dir: str) -> None:
    """Write the model, its whole `state_dict` (the run's Sharding.full_state_dict: ZeRO-3 or FSDP2 shards gathered;
    on the main process) as safetensors + tokenizer to `out_dir`, atomically and
    durably: into `out_dir.tmp`, synced, then renamed in, an earlier `out_dir` renamed aside first and deleted last
    (durable.replace_dir). A write that fails (no space) is one line, the earlier `out_dir` intact. A LoRA model:
    the adapter in `out_dir`, the merged model in `out_dir/merged` (verl_kit.models.lora.export_adapter)."""
    if accelerator.is_main_process:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        try:
            if peft_model(unwrapped) is not None:
                export_adapter(unwrapped, state_dict, tokenizer, tmp)
            else:
                unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
            replace_dir(tmp, out_dir)
        except Exception as e:
            reason = write_failure(e, os.path.dirname(os.path.abspath(out_dir)))
            if reason is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"{out_dir}: writing the final model failed ({reason}); the checkpoints and any earlier "
                            f"{os.path.basename(out_dir)}/ are intact") from None
    accelerator.wait_for_everyone()
