"""verl_kit.models.loading: a teacher's tokenizer must be the student's (on-policy distillation), else one line that
names the flag; the online recipes' policy without dropout, checkpointing in training mode."""

import pytest
import torch

from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.models import check_shared_tokenizer, load_policy, load_tokenizer, without_dropout


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
