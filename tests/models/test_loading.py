"""verl_kit.models.loading: a teacher's tokenizer must be the student's (on-policy distillation), else one line that
names the flag; the online recipes' policy without dropout, checkpointing in training mode; --chat_template_kwargs
and TRL's training templates as the tokenizer's defaults."""

import pytest
import torch

from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.models import chat_template_kwargs, check_shared_tokenizer, load_policy, load_tokenizer, without_dropout


def test_teacher_tokenizer_must_be_the_students(tiny_model_path, tmp_path):
    """The same tokenizer passes; an added token, another EOS or another chat template are refused in one line that
    names the flag."""
    student = load_tokenizer(tiny_model_path)
    check_shared_tokenizer(student, load_tokenizer(tiny_model_path), "--teacher_model_name_or_path t")
    cases = {}
    added = load_tokenizer(tiny_model_path)
    added.add_tokens(["zqxj"])
    cases["vocabularies differ"] = added
    eos = load_tokenizer(tiny_model_path)
    eos.eos_token = eos.convert_ids_to_tokens(5)
    cases["special tokens differ"] = eos
    template = load_tokenizer(tiny_model_path)
    template.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    cases["chat templates give a conversation different token ids"] = template
    for why, teacher in cases.items():
        with pytest.raises(UserError) as e:
            check_shared_tokenizer(student, teacher, "--teacher_model_name_or_path t")
        msg = str(e.value)
        assert msg.startswith("--teacher_model_name_or_path t: the teacher's tokenizer is not the student's: "), msg
        assert why in msg and "\n" not in msg, msg


def test_online_policy_checkpoints_in_training_mode_without_dropout(tiny_model_path):
    """grpo/ppo/distill's policy (models.without_dropout, then .train()): with LoRA and its dropout of 0.5 and an
    attention dropout of 0.5, a training-mode forward equals the eval-mode one and keeps a tenth of the activations
    for the backward (gradient checkpointing runs: transformers checkpoints in training mode only, and the recipes left
    the policy in eval mode before, so --gradient_checkpointing did nothing there)."""
    cfg = TrainConfig(use_peft=True, lora_dropout=0.5, gradient_checkpointing=True)
    torch.manual_seed(0)
    model = load_policy(tiny_model_path, cfg)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    without_dropout(model)
    ids = torch.randint(5, model.config.vocab_size, (2, 24))
    logits, saved = {}, {}
    for training in (False, True):
        model.train(training)
        saved[training] = 0

        def count(t, training=training):
            saved[training] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            logits[training] = model(input_ids=ids).logits
    assert torch.equal(logits[True], logits[False])
    # what the forward keeps for the backward outside checkpointed layers: 108,512 against 1,107,488 numbers
    assert saved[True] < saved[False] / 5, saved


def test_chat_template_kwargs_reach_every_rendering(tiny_model_path, tmp_path):
    """--chat_template_kwargs '{"enable_thinking": false}' (models.load_tokenizer): a template that reads the variable
    renders it in RL prompts (data.load_prompts), preference data (TRL's maybe_apply_chat_template) and SFT
    conversations, and a distillation teacher's tokenizer is loaded with the student's; without the flag nothing
    changes, and the saved tokenizer does not carry it."""
    from datasets import Dataset

    from verl_kit.data import preference_examples, sft_examples
    from verl_kit.data.prompts import load_prompts
    from verl_kit.models import CHAT_TEMPLATE

    tok = load_tokenizer(tiny_model_path)
    thinking_off = "{% if enable_thinking is defined and not enable_thinking %}<|system|>{% endif %}"
    tok.chat_template = thinking_off + CHAT_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    user = [{"role": "user", "content": "hello there"}]
    reply = [{"role": "assistant", "content": "a kind reply"}]
    marker = tok.convert_tokens_to_ids("<|system|>")

    def rendered(kwargs):
        t = load_tokenizer(str(tmp_path / "tok"), kwargs)
        prompt = load_prompts([{"prompt": user}], t, 64, "prompts")[0]
        pref = preference_examples(Dataset.from_list([{"prompt": user, "chosen": reply, "rejected": reply}]), t,
                                   64, 128, "prefs")[0].prompt_ids
        sft = sft_examples(Dataset.from_list([{"messages": user + reply}]), t, 64, 128, "sft")[0].input_ids
        return t, [marker in ids for ids in (prompt, pref, sft)]

    plain, seen = rendered(None)
    assert seen == [False] * 3 and chat_template_kwargs(plain) == {}
    off, seen = rendered({"enable_thinking": False})
    assert seen == [True] * 3 and chat_template_kwargs(off) == {"enable_thinking": False}
    assert marker in off.apply_chat_template(user, add_generation_prompt=True, return_dict=False)
    assert marker not in off.apply_chat_template(user, add_generation_prompt=True, return_dict=False,
                                                 enable_thinking=True)  # a call's own value wins
    teacher = str(tmp_path / "tok")  # load_teacher's check: the teacher's tokenizer with the student's kwargs
    check_shared_tokenizer(off, load_tokenizer(teacher, chat_template_kwargs(off)), "--teacher_model_name_or_path t")
    with pytest.raises(UserError, match="chat templates give"):
        check_shared_tokenizer(off, load_tokenizer(teacher), "--teacher_model_name_or_path t")
    off.save_pretrained(tmp_path / "saved")
    assert chat_template_kwargs(load_tokenizer(str(tmp_path / "saved"))) == {}


def test_qwen3_template_trains_multi_turn_through_trls_training_template(tiny_model_path, tmp_path):
    """TRL 1.16's Qwen3 chat template (not prefix-preserving: it drops earlier turns' reasoning, and a tool turn
    rewrites the text before it) on the tiny tokenizer with Qwen3's special tokens: refused for episodes as it is;
    loaded for a multi-turn run, TRL's qwen3 training template becomes the tokenizer's default and passes the
    episodes' six-turn prefix check, with and without tool messages; --chat_template_kwargs reaches it."""
    from helpers import qwen3_tokenizer
    from trl.chat_template_utils import qwen3_training_chat_template

    from verl_kit.rollout.chat import check_prefix_property
    from verl_kit.rollout.tools import supports_tools

    path = qwen3_tokenizer(tiny_model_path, tmp_path / "qwen3")
    plain = load_tokenizer(path)
    assert supports_tools(plain)
    with pytest.raises(UserError, match="^qwen3-tiny: the chat template does not extend a conversation by appending"):
        check_prefix_property(plain, "qwen3-tiny", native_tools=True)
    multi = load_tokenizer(path, {"enable_thinking": False}, multi_turn=True)
    assert chat_template_kwargs(multi) == {"chat_template": qwen3_training_chat_template, "enable_thinking": False}
    for native_tools in (True, False):
        check_prefix_property(multi, "qwen3-tiny", native_tools)
    user = [{"role": "user", "content": "hi"}]
    assert multi.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert chat_template_kwargs(load_tokenizer(tiny_model_path, multi_turn=True)) == {}  # a template TRL lacks
