"""Session fixtures: what is expensive to make is made once per run of the suite and shared by the tests that only
need it running (the tiny and the real model, one vLLM server on the tiny model); tests that kill, crash or resume
an engine start their own.

The folders mirror verl_kit/ (algos/, data/, models/, train/, rollout/, rewards/, launch/) plus recipes/ (each recipe's
learning, resume and multi-process runs, one file per recipe). They have no __init__.py: pytest's default (prepend)
import mode puts each test file's folder and this one on sys.path, so `from helpers import ...` works everywhere and
every test file's name must be unique across the folders."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# DeepSpeed's CPU Adam (ZeRO-3 offload) from the one JIT build `make install` made, also when pytest runs outside make.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_model_path():
    """The embedded tiny model, built offline (once per cache)."""
    from verl_kit.models import resolve_model_path

    return resolve_model_path("tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from verl_kit.models import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_tied_path(tmp_path_factory):
    """The tiny model with tied embeddings (the output layer is the input embedding, as in SmolLM2)."""
    from verl_kit.models import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tied") / "model"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def smollm2_path():
    """The packaged real model (SmolLM2-135M-Instruct), converted from the GGUF `make install` fetched: once per
    cache, resolved once per session."""
    import time

    from verl_kit.models import resolve_model_path

    t0 = time.time()
    path = resolve_model_path("smollm2-135m")
    print(f"smollm2-135m resolved in {time.time() - t0:.1f}s: {path}")
    return path


# ---- one vLLM server on the tiny model, for every test that only needs one running ------------------------------

SERVER_USERS: list = []  # the collected tests that use `vllm_server`, in run order


def pytest_collection_finish(session):
    SERVER_USERS[:] = [item for item in session.items if "vllm_server" in getattr(item, "fixturenames", ())]


class SharedServer:
    """The session's server, started by the first test that asks for it and stopped after the last one (not at the
    end of the session: an idle vLLM server holds ~3 GB). It starts as a user starts one, `make vllm-serve` (with its
    key in VLLM_API_KEY, as docs/rollouts.md says for a key of one's own), so every server test runs that command;
    over TLS with a self-signed certificate (`.tls`; `.server.ca_file` verifies it), so every server test, syncs and
    recipe runs included, speaks https."""

    server = None

    def get(self, tiny_model_path):
        if self.server is None:
            from verl_kit.rollout import ServerProcess

            class MakeServe(ServerProcess):
                def command(self, model_path, host, serve_kwargs):
                    args = " ".join(f"--{k} {v}" for k, v in serve_kwargs.items())
                    return ["make", "-s", "--no-print-directory", "-C", str(REPO), "vllm-serve",
                            f"MODEL={model_path}", f"VLLM_PORT={self.port}", f"VLLM_ARGS={args}"]

            import tempfile

            from verl_kit.rollout.vllm_server import self_signed_certificate

            os.environ["VLLM_HOST_IP"] = "127.0.0.1"
            cert, key = self_signed_certificate(["127.0.0.1"], tempfile.mkdtemp(prefix="verl-kit-test-tls-"))
            self.tls = {"ssl_certfile": cert, "ssl_keyfile": key}
            self.server = MakeServe(tiny_model_path, dtype="float32", max_num_seqs=64, max_model_len=512,
                                    kv_cache_gib=1, startup_timeout_s=400, **self.tls)
        assert self.server.proc.poll() is None, "the shared vLLM server died (a test must not kill it)"
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


SHARED = SharedServer()


@pytest.fixture
def vllm_server(tiny_model_path):
    """A running ServerProcess (fp32, 127.0.0.1) on the tiny model, shared by the session. Its weights are whatever
    the previous user synced: a test that compares with the base model syncs it first. It requires its key
    (`.api_key`) on every request: clients in this process get it by themselves (vllm_server.use_key), a recipe run
    against it needs VLLM_API_KEY=vllm_server.api_key."""
    return SHARED.get(tiny_model_path)


def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`), a work unit at a time: each
    test module is one unit (its module fixtures are made once; a module that sets `XDIST_UNIT = "test"` has none
    worth sharing and is split test by test), except that every test marked `vllm` (it starts a vLLM engine or server)
    or using the shared server is in one unit, `vllm`, run by one worker, one test after the other: a CPU engine
    computes on the same core whichever test starts it, and the shared server is started once."""
    for item in items:
        if item.get_closest_marker("vllm") or "vllm_server" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif getattr(item.module, "XDIST_UNIT", "module") == "module":
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_runtest_teardown(item, nextitem):
    if SERVER_USERS and item is SERVER_USERS[-1]:
        SHARED.stop()


def pytest_sessionfinish(session, exitstatus):
    SHARED.stop()
