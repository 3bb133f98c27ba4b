"""Memory that does not grow with the vocabulary: the tiny model widened to Qwen's 151,936-token vocabulary takes two
GRPO updates on 4096-token sequences (a group of 2 responses of 1024 tokens after a shared 3072-token prompt) within a
peak resident memory of 3 GiB, where the whole-logits path takes 7.3 GiB (tests/train/vocab_memory_worker.py,
verl_kit/train/lm_head.py)."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from helpers import REPO, env

WORKER = str(REPO / "tests" / "train" / "vocab_memory_worker.py")
VOCAB = 151_936
RESPONSES, PROMPT, LENGTH = 2, 3072, 1024
# Measured on CPU (one thread, packed segment attention): 1.79 GiB peak through the chunked head, of which ~1.4 GiB is
# the process, the model and AdamW at any size. One fp32 copy of the scored tokens' logits is 2 x 1024 x 151,936 x
# 4 B = 1.16 GiB, and the whole-logits path (the worker's `full`) holds several: 7.28 GiB on the same two updates.
BOUND_GIB = 3.0


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tiny_model_path):
    """The tiny model with its embedding and output layer widened to 151,936 rows (transformers' resize)."""
    from verl_kit.models import load_causal_lm, load_tokenizer

    path = tmp_path_factory.mktemp("wide") / "model"
    model = load_causal_lm(tiny_model_path)
    model.resize_token_embeddings(VOCAB)
    model.save_pretrained(path)
    load_tokenizer(tiny_model_path).save_pretrained(path)
    return str(path)


def peak_rss_gib(cmd: list[str], timeout: float) -> float:
    """Run `cmd` to the end and return its peak resident memory (wait4's rusage.ru_maxrss, KiB on Linux, of that
    process alone); its process group is killed after `timeout` seconds."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env(OMP_NUM_THREADS=1), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    try:
        stderr = p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
    finally:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0, stderr[-3000:]
    return usage.ru_maxrss / 2**20


def test_two_grpo_updates_at_152k_vocabulary_within_bound(wide_model, tmp_path):
    out = tmp_path / "steps.json"
    peak = peak_rss_gib([sys.executable, WORKER, wide_model, str(out), str(RESPONSES), str(PROMPT), str(LENGTH),
                         "chunked"], timeout=420)
    result = json.loads(out.read_text())
    assert result["vocab"] == VOCAB
    assert [s["tokens"] for s in result["steps"]] == [RESPONSES * LENGTH] * 2
    # random weights over 151,936 tokens: the entropy is near log(151,936) = 11.93
    assert all(11.5 < s["entropy"] < 11.94 for s in result["steps"]), result
    print(f"peak RSS {peak:.2f} GiB: {RESPONSES} x ({PROMPT} + {LENGTH}) tokens, vocabulary {VOCAB}")
    assert peak < BOUND_GIB
