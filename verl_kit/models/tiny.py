"""The embedded default: a tiny Llama-style model, its BPE tokenizer and a synthetic preference task, all built offline.

The task ("tone") is a preference between two replies to the same request that differ only in the polarity of their
adjectives: chosen replies are kind, rejected replies are dismissive. Openers, closers, topics and lengths are shared
and drawn at random, so a model can only separate the two by learning which adjectives are preferred; the held-out
split uses fresh combinations. Regenerate the shipped files with `python -m verl_kit.models tiny-data`.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY_PREFS = str(ASSETS / "tiny_prefs")  # directory with train.jsonl and test.jsonl (conversational, explicit prompt)
TINY_MODEL_NAME = "tiny-llama"  # resolved by verl_kit.models.loading.resolve_model_path to a model built on first use

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

TOPICS = (
    "the sea, the forest, my garden, this song, the city, the old bridge, the museum, the new phone, the river, "
    "the market, the library, the mountain, our team, the film, the bakery, the harbour, the park, the train, the "
    "school, the festival, the village, the desert, the lake, the castle, the island, the stadium, the theatre, the "
    "kitchen, the painting, the novel"
).split(", ")
ASKS = ["Tell me about {t}.", "What do you think of {t}?", "Describe {t}.", "Give me your view on {t}.",
        "How would you sum up {t}?", "Say something about {t}."]
OPENERS = ["Well,", "So,", "Honestly,", "In short,", "I think", "To me,", "Overall,", "Right,"]
CLOSERS = ["That is all.", "There you go.", "That is my view.", "Make of it what you will.", "Enough said.", ""]
GOOD = ["lovely", "bright", "warm", "kind", "calm", "gentle", "wonderful", "charming", "cheerful", "delightful",
        "graceful", "friendly", "pleasant", "brilliant", "peaceful", "splendid"]
BAD = ["dull", "grim", "cold", "rude", "noisy", "harsh", "awful", "dreary", "gloomy", "tedious", "bleak",
       "hostile", "nasty", "dismal", "shabby", "boring"]


def _reply(rng: random.Random, topic: str, opener: str, closer: str, n_adj: int, words: list[str]) -> str:
    adjs = rng.sample(words, n_adj)
    body = adjs[0] if n_adj == 1 else ", ".join(adjs[:-1]) + " and " + adjs[-1]
    return " ".join(x for x in [opener, f"{topic} is {body}.", closer] if x)


def make_preference_rows(n: int, seed: int) -> list[dict]:
    """Conversational preference rows with an explicit prompt (TRL's format)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic, ask = rng.choice(TOPICS), rng.choice(ASKS)
        opener, closer, n_adj = rng.choice(OPENERS), rng.choice(CLOSERS), rng.randint(1, 4)
        rows.append({
            "prompt": [{"role": "user", "content": ask.format(t=topic)}],
            "chosen": [{"role": "assistant", "content": _reply(rng, topic, opener, closer, n_adj, GOOD)}],
            "rejected": [{"role": "assistant", "content": _reply(rng, topic, opener, closer, n_adj, BAD)}],
        })
    return rows


def write_preference_data(out_dir: str = TINY_PREFS, n_train: int = 2000, n_test: int = 200) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for split, n, seed in [("train", n_train, 0), ("test", n_test, 1)]:
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for row in make_preference_rows(n, seed):
                f.write(json.dumps(row) + "\n")


def _corpus() -> list[str]:
    words = TOPICS + ASKS + OPENERS + CLOSERS + GOOD + BAD
    rows = make_preference_rows(500, seed=123)
    texts = [m["content"] for r in rows for k in ("prompt", "chosen", "rejected") for m in r[k]]
    return words + texts + ["The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - = ? !"] * 4


def build_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained on the task's own text, wrapped as a fast HF tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE, model_max_length=1024)


def build_tiny_model(out_dir: str, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
                     intermediate_size: int = 512, vocab_size: int = 1024, seed: int = 0,
                     tie_word_embeddings: bool = False) -> str:
    """Write a randomly initialised Llama (head_dim 64, vLLM-compatible) and its tokenizer to `out_dir`, atomically.
    `tie_word_embeddings`: the output layer is the input embedding (one tensor, saved once, like SmolLM2 or Qwen2.5
    small models); the embedded default is untied."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=1024, tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-tiny-")
    model.save_pretrained(tmp, is_main_process=True)
    tokenizer.save_pretrained(tmp)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not os.path.isfile(f"{tmp}/{f}")]
    if missing:
        raise RuntimeError(f"building the tiny model wrote no {', '.join(missing)} in {tmp}")
    if os.path.isdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)  # a broken earlier build
    try:
        os.rename(tmp, out_dir)  # another process may have won the race: theirs is identical
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
