"""Secrets stay off the Ray dashboard: `cluster run` puts no credential in the job's runtime_env (Ray shows it in
clear on the dashboard and the job API, and passes it on worker command lines), and `cluster up` on an address other
machines reach refuses to start without Ray's token auth. Both checked on the commands and environments the CLI
builds: no Ray cluster is started (the job client is a stub that records the submission; `ray start` is not run)."""

from __future__ import annotations

import os
import subprocess

import pytest

from verl_kit.launch import cluster

SECRETS = {"HF_TOKEN": "hf_secret1", "HUGGING_FACE_HUB_TOKEN": "hf_secret2", "WANDB_API_KEY": "wandb_secret3",
           "HF_HUB_TOKEN": "hf_secret4", "VERL_KIT_SECRET_PASSWORD": "secret5"}
PLAIN = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_PROJECT": "p", "NCCL_DEBUG": "INFO",
         "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}


class StubJobClient:
    """Records what `cluster run` submits (the job API is Ray's, not under test)."""

    def __init__(self):
        self.submitted = []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return kwargs["submission_id"]


def test_run_sends_no_secret_in_the_runtime_env(monkeypatch, tmp_path, capsys):
    """HF_TOKEN, WANDB_API_KEY and the like are left out of the submitted job (names and values), said so in one
    line; the non-secret variables of the same prefixes still travel. On main every HF_*/WANDB_* went."""
    for k, v in {**SECRETS, **PLAIN}.items():
        monkeypatch.setenv(k, v)
    stub = StubJobClient()
    monkeypatch.setattr(cluster, "_client", lambda address: stub)
    rc = cluster.main(["run", "--detach", "--nodes", "2", "--", "--output_dir", str(tmp_path / "out")])
    assert rc == 0
    (job,) = stub.submitted
    env = job["runtime_env"]["env_vars"]
    assert {k: env.get(k) for k in PLAIN} == PLAIN
    leaked = [k for k in SECRETS if k in env] + [v for v in SECRETS.values() if v in repr(job)]
    assert not leaked, leaked
    out = capsys.readouterr().out
    named = "HF_HUB_TOKEN, HF_TOKEN, VERL_KIT_SECRET_PASSWORD, WANDB_API_KEY"  # HUGGING_FACE_*: no prefix sent
    assert f"not sent to the nodes (secrets): {named};" in out, out
    assert not any(v in out for v in SECRETS.values())


def test_job_env_keeps_plain_names_that_contain_a_secret_word_as_a_part():
    env, withheld = cluster.job_env({"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": "x", "WANDB_API_KEY": "y",
                                     "TORCH_KEYS_ARE_FINE": "1", "PATH": "/bin"})
    assert env == {"TOKENIZERS_PARALLELISM": "false", "TORCH_KEYS_ARE_FINE": "1"}
    assert withheld == ["HF_TOKEN", "WANDB_API_KEY"]


@pytest.fixture
def ray_start(monkeypatch, tmp_path):
    """`cluster up`'s calls to `ray start` (command, RAY_AUTH_MODE), recorded instead of run; HOME in tmp_path (no
    ~/.ray/auth_token)."""
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: calls.append((cmd, os.environ.get("RAY_AUTH_MODE"))) or 0)
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    return calls


def test_up_always_runs_with_token_auth(ray_start, monkeypatch, tmp_path, capsys):
    """Every `up` runs Ray with token auth, loopback included: a local head with no token generates one (mode 600,
    said in one line) and starts with RAY_AUTH_MODE=token; RAY_AUTH_MODE=disabled is refused in one line; a node that
    joins needs the head's token; a token file other users can read is refused; a token in the environment needs no
    file. (The head refusing a client without the token: test_cluster.py's cluster fixture.) Before, a loopback head
    ran without auth: any local user could submit jobs as the user who started it."""
    token = tmp_path / ".ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    for argv in (["up"], ["up", "--node_ip", "10.0.0.1"]):
        with pytest.raises(SystemExit, match=r"^error: cluster up on \S+: RAY_AUTH_MODE=disabled is refused"):
            cluster.main(argv)
    monkeypatch.delenv("RAY_AUTH_MODE")
    with pytest.raises(SystemExit, match=r"joining 10.0.0.1:6379 needs the head's Ray token, and there is none"):
        cluster.main(["up", "--address", "10.0.0.1:6379", "--node_ip", "10.0.0.2"])
    assert ray_start == [] and not token.exists()
    assert cluster.main(["up"]) == 0  # a local head on 127.0.0.1: a token made on first use
    assert ray_start[-1][1] == "token" and len(token.read_text()) == 64 and token.stat().st_mode & 0o777 == 0o600
    assert f"generated Ray's auth token in {token} (mode 600)" in capsys.readouterr().out
    first = token.read_text()
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert cluster.main(["up", "--node_ip", "10.0.0.1"]) == 0 and token.read_text() == first  # reused
    token.chmod(0o644)  # as `ray get-auth-token --generate` leaves it under umask 022
    with pytest.raises(SystemExit, match=f"readable by other users .*chmod 600 {token}"):
        cluster.main(["up", "--node_ip", "10.0.0.1"])
    token.chmod(0o600)
    assert cluster.main(["up", "--address", "10.0.0.1:6379", "--node_ip", "10.0.0.2"]) == 0
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 64)  # a token in the environment: no file needed
    os.remove(token)
    assert cluster.main(["up", "--address", "10.0.0.1:6379", "--node_ip", "10.0.0.2"]) == 0
    assert [(c[c.index("--node-ip-address") + 1], mode) for c, mode in ray_start] == [
        ("127.0.0.1", "token"), ("10.0.0.1", "token"), ("10.0.0.2", "token"), ("10.0.0.2", "token")]
