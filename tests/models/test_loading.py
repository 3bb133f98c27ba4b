"""verl_kit.models.loading: a teacher's tokenizer must be the student's (on-policy distillation), else one line that
names the flag."""

import pytest

from verl_kit.errors import UserError
from verl_kit.models import check_shared_tokenizer, load_tokenizer


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
