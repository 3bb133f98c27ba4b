"""Rewards: a reward model with its own tokenizer and chat template (re-tokenization across deliberately different
vocabularies), reward functions loaded from a module or a file, weighted sums, and errors that name the function and
the sample."""

import math

import pytest
import torch

from verl_kit.errors import UserError
from verl_kit.rewards import RewardModel, call_reward_fn, kind_words, load_reward_fn, load_reward_model, weighted_sum

RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"


def build_reward_model(out: str) -> str:
    """A tiny LlamaForSequenceClassification over a *different* tokenizer: a 300-token BPE trained on other text,
    other special tokens and another chat template than the policy's. Written to `out`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["[USER] [ASSISTANT] the cat sat on the mat", "kind words and warm replies", "zebra quartz jukebox"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        chat_template=RM_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_reward_model(str(tmp_path_factory.mktemp("rm")))


def _load(path):
    return load_reward_model(path, lambda load: load().eval(), "cpu", max_length=256, batch_size=2)


def test_reward_model_retokenizes_with_its_own_template(reward_model_dir, tokenizer):
    """The policy's completion text is rendered with the reward model's chat template and tokenized with the reward
    tokenizer; the policy tokenizer would give other ids for the same text (the vocabularies differ). The score of
    each sample equals a forward pass of the reward model on exactly that text, alone and unpadded, so batching
    (by sorted length, 2 per batch here: the longest and the shortest sample land in different batches) and
    right-padding inside score() do not change it, nor the order of the scores."""
    rm = _load(reward_model_dir)
    prompts = [[{"role": "user", "content": "Describe the sea."}], "plain prompt: ", "mid: "]
    completions = ["The sea is calm and kind.", "zebra", "a calm reply"]
    texts = rm.texts(prompts, completions)
    assert texts[:2] == ["[USER] Describe the sea.\n[ASSISTANT] The sea is calm and kind.\n", "plain prompt: zebra"]
    policy_ids = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    rm_ids = rm.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert policy_ids != rm_ids
    assert rm.tokenizer.decode(rm_ids) == texts[0]
    scores = rm.score(prompts, completions)
    assert scores.shape == (3,)
    with torch.no_grad():
        for text, score in zip(texts, scores):
            ids = torch.tensor([rm.tokenizer(text, add_special_tokens=False)["input_ids"]])
            torch.testing.assert_close(rm.model(input_ids=ids).logits[0, 0], score, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores[0], scores[1])


def test_kind_words_and_weighted_sum():
    """'lovely, warm day' has 3 words, 2 of them kind: 2/3; 'dull' 0; empty 0 (no division by zero).
    weighted_sum([a, b], [1, 0.5]) = a + 0.5 b: [2/3 + 0.5, 0 + 1.0, 0 + 0]."""
    a = call_reward_fn("kind", kind_words, ["p"] * 3, ["Lovely, warm day.", "dull", ""])
    torch.testing.assert_close(a, torch.tensor([2 / 3, 0.0, 0.0]))
    b = torch.tensor([1.0, 2.0, 0.0])
    torch.testing.assert_close(weighted_sum([a, b], [1.0, 0.5]), torch.tensor([2 / 3 + 0.5, 1.0, 0.0]))


def test_load_reward_fn_from_module_and_file(tmp_path):
    assert load_reward_fn("verl_kit.rewards:kind_words") is kind_words
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompts, completions):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_fn(f"{f}:length")
    torch.testing.assert_close(call_reward_fn("length", fn, ["a", "b"], ["xy", ""]), torch.tensor([2.0, 0.0]))
    for spec, says in [("no_colon", "expected module:function"), (f"{tmp_path}/missing.py:f", "no such file"),
                       ("verl_kit.nope:f", "cannot import"), (f"{f}:nope", "no function 'nope'")]:
        with pytest.raises(UserError, match=says):
            load_reward_fn(spec)


def test_reward_fn_errors_name_function_and_sample():
    prompts, completions = ["p0", "p1", "p2"], ["ok", "boom here", "ok"]

    def raises(prompts, completions):
        return [1 / 0 if "boom" in c else 1.0 for c in completions]

    with pytest.raises(UserError, match=r"reward function raises raised ZeroDivisionError.*sample 1 \(prompt 'p1'"):
        call_reward_fn("raises", raises, prompts, completions)
    with pytest.raises(UserError, match=r"reward function nan returned nan for sample 2 \(prompt 'p2'"):
        call_reward_fn("nan", lambda p, c: [0.0, 1.0, math.nan], prompts, completions)
    with pytest.raises(UserError, match=r"reward function short returned 2 values for 3 samples"):
        call_reward_fn("short", lambda p, c: [0.0, 1.0], prompts, completions)
    with pytest.raises(UserError, match=r"reward function text returned 'x' for sample 0"):
        call_reward_fn("text", lambda p, c: ["x", 1.0, 1.0], prompts, completions)


def test_reward_model_is_frozen_and_deterministic(reward_model_dir):
    """Placed by actor_critic.frozen (a plain module here, no DeepSpeed): no gradients, eval mode, same scores."""
    from accelerate import Accelerator

    from verl_kit.actor_critic import frozen

    accelerator = Accelerator(cpu=True)
    rm = load_reward_model(reward_model_dir, lambda load: frozen(accelerator, load), "cpu", 256, 2)
    assert isinstance(rm, RewardModel)
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training
    s1 = rm.score(["a"] * 3, ["x", "yy", "zzz"])
    s2 = rm.score(["a"] * 3, ["x", "yy", "zzz"])
    assert torch.equal(s1, s2)
