import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model_path():
    """The embedded tiny model, built offline (once per cache)."""
    from verl_kit.models import resolve_model_path

    return resolve_model_path("tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from verl_kit.models import load_tokenizer

    return load_tokenizer(tiny_model_path)
