"""Ray cluster runs on a real two-node Ray cluster built on this machine: two network namespaces joined by a veth pair
(head 10.200.0.1 in one, worker 10.200.0.2 in the other), each with its own raylet, so the job's two accelerate
launches talk gloo across the veth exactly as two hosts would. Nothing leaves the namespaces this file creates; the
namespaces, every process in them and the Ray temp dirs are removed at the end, also on failure."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from helpers import REPO, env, isolated, metrics

from verl_kit.launch import processes
from verl_kit.launch.cluster import launch_command, parse

HEAD_IP, WORKER_IP = "10.200.0.1", "10.200.0.2"
DASHBOARD = f"http://{HEAD_IP}:8265"
NODE_TIMEOUT_S = 30
# 12 steps with a checkpoint every 3: a node is killed after checkpoint-6 (6 steps still to go), frozen after
# checkpoint-3; short enough for 2 CPU cores.
STEPS = 12
RECIPE_ARGS = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_steps", "3", "--dataset_test_split", "none"]


def test_launch_command_adds_the_multi_node_fields():
    args = parse(["_driver", "--nodes", "2", "--procs_per_node", "4", "--config", "c.yaml", "--", "--beta", "0.2"])
    cmd = launch_command(args, rank=1, main_ip="10.0.0.1", port=29400, ds_standard=True)
    i = cmd.index("accelerate.commands.launch")
    assert cmd[i + 1:] == ["--config_file", "accelerate_configs/zero3.yaml", "--num_machines", "2",
                           "--num_processes", "8", "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
                           "--main_process_port", "29400", "--deepspeed_multinode_launcher", "standard",
                           "recipes/dpo.py", "--config", "c.yaml", "--beta", "0.2"]


def test_rollout_servers_serve_the_recipes_model(tmp_path):
    """`run --rollout_servers`: each server runs the kit's `vllm_server serve` for the recipe's model (from its flags,
    else its --config yaml) on the node's address, over TLS with the job's certificate, with --server_args."""
    from verl_kit.launch.cluster import recipe_value, server_command

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: from-yaml\nlearning_rate: 0.1\n")
    args = parse(["_driver", "--rollout_servers", "2", "--server_args=--dtype bfloat16", "--config", str(cfg), "--",
                  "--model_name_or_path=from-flag"])
    assert recipe_value(args, "model_name_or_path") == "from-flag" and recipe_value(args, "learning_rate") == "0.1"
    tls = ("/t/cert.pem", "/t/key.pem")
    cmd = server_command(args, "10.0.0.3", 8100, tls)
    assert cmd[1:] == ["-m", "verl_kit.rollout.vllm_server", "serve", "--model", "from-flag", "--host", "10.0.0.3",
                       "--port", "8100", "--ssl_certfile", "/t/cert.pem", "--ssl_keyfile", "/t/key.pem", "--dtype",
                       "bfloat16"]
    args = parse(["_driver", "--rollout_servers", "1", "--config", str(cfg)])
    assert server_command(args, "10.0.0.3", 1, tls)[5] == "from-yaml" and "float32" in server_command(args, "h", 1, tls)


def test_reaper_takes_the_whole_tree_down_when_its_agent_dies(tmp_path):
    """The reaper outlives a SIGKILLed agent (it is detached from it, as Ray SIGKILLs a dead worker's children) and
    then ends the launch and the rank the launch started in its own session (as torchrun does)."""
    import psutil

    agent = subprocess.Popen(["sleep", "120"])  # stands in for the Ray actor
    marker = tmp_path / "rank.pid"
    launch = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
              f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    reaper = subprocess.Popen(processes.reaper_command(agent.pid, [sys.executable, "-c", launch], 2),
                              stdout=subprocess.PIPE)
    pids: list[int] = []  # the reaper, then the rank
    try:
        first = reaper.stdout.readline().decode()
        assert first.startswith("\x00verl-kit-reaper pid "), first
        pids.append(int(first.split()[-1]))
        deadline = time.time() + 30
        while not marker.exists() or not marker.read_text():
            assert time.time() < deadline, "the launch never started its rank"
            time.sleep(0.1)
        pids.append(int(marker.read_text()))
        agent.kill()
        agent.wait()
        def alive() -> list[int]:
            out = []
            for p in pids:
                try:
                    if psutil.Process(p).status() != "zombie":
                        out.append(p)
                except psutil.NoSuchProcess:  # gone between the listing and the read of its status
                    pass
            return out

        deadline = time.time() + 15
        while alive() and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(), "reaper or rank survived"
        assert reaper.stdout.read().decode().strip().splitlines()[-1] == "\x00verl-kit-reaper exit 143"
    finally:
        agent.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaper.wait()


# ---- the two-node cluster ------------------------------------------------------------------------------------------

RAY_TOKEN = secrets.token_hex(32)  # this test cluster's Ray auth token (`cluster up` beyond loopback requires one)


def _clean_env(**extra) -> dict:
    """The nodes' and the client's environment: interface choice is left to each node (the driver picks the
    interface carrying the node's Ray address), Ray's token auth is on (its nodes are on routable addresses) and
    nothing phones home."""
    e = env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TOKEN, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
            **extra)
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        e.pop(k, None)
    return e


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _ns_pids(ns: str) -> list[int]:
    """Every process whose network namespace is `ns`."""
    try:
        ino = os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return []
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if os.stat(f"/proc/{d}/ns/net").st_ino == ino:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def _kill_ns(ns: str) -> None:
    for _ in range(50):
        pids = _ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _procs_with(text: str) -> list[str]:
    """Command lines (other than ours) that mention `text`: stray training processes."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(f"{d}: {cmd}")
    return out


class Cluster:
    def __init__(self, head_ns: str, worker_ns: str):
        self.head_ns, self.worker_ns = head_ns, worker_ns

    def cli(self, *args: str, timeout: float = 300, ns: str | None = None) -> subprocess.CompletedProcess:
        """`python -m verl_kit.launch.cluster ...` on the head node (or in `ns`), as a user runs `make cluster-*`."""
        cmd = ["ip", "netns", "exec", ns or self.head_ns, sys.executable, "-m", "verl_kit.launch.cluster", *args]
        return subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=timeout)

    def run_cmd(self, output_dir: str, *extra: str, node_timeout_s: float = NODE_TIMEOUT_S,
                config: str = "zero3.yaml") -> list[str]:
        return ["ip", "netns", "exec", self.head_ns, sys.executable, "-m", "verl_kit.launch.cluster", "run",
                "--address", DASHBOARD, "--nodes", "2", "--procs_per_node", "1",
                "--accelerate_config", f"accelerate_configs/{config}", "--node_timeout_s", str(node_timeout_s),
                "--stop_grace_s", "5", "--", *RECIPE_ARGS, "--output_dir", output_dir, *extra]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to build the two-namespace cluster")
    tag = f"vk{os.getpid() % 100000}"
    head_ns, worker_ns = f"{tag}h", f"{tag}w"
    tmp = tempfile.mkdtemp(prefix="vkc-", dir="/tmp")  # short: Ray's unix socket paths live under it
    try:
        _sh("ip", "netns", "add", head_ns)
        _sh("ip", "netns", "add", worker_ns)
        _sh("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for ns, dev, ip in ((head_ns, f"{tag}a", HEAD_IP), (worker_ns, f"{tag}b", WORKER_IP)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        c = Cluster(head_ns, worker_ns)
        p = c.cli("up", "--node_ip", HEAD_IP, "--num_cpus", "2", "--temp_dir", f"{tmp}/head", timeout=120)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        p = c.cli("up", "--address", f"{HEAD_IP}:6379", "--node_ip", WORKER_IP, "--num_cpus", "2",
                  "--temp_dir", f"{tmp}/worker", ns=worker_ns, timeout=120)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        deadline = time.time() + 60
        while "nodes: 2 alive" not in (status := c.cli("status", "--address", DASHBOARD, timeout=60).stdout):
            assert time.time() < deadline, f"worker never joined:\n{status}"
            time.sleep(1)
        # the head refuses a client without its token (`cluster up` always runs Ray's token auth)
        probe = ("import urllib.request, urllib.error\ntry:\n    urllib.request.urlopen(%r, timeout=10); print(200)\n"
                 "except urllib.error.HTTPError as e:\n    print(e.code)" % (DASHBOARD + "/api/jobs/"))
        p = subprocess.run(["ip", "netns", "exec", head_ns, sys.executable, "-c", probe], capture_output=True,
                           text=True, timeout=60, env=env())
        assert p.stdout.strip() in ("401", "403"), (p.stdout, p.stderr[-2000:])
        yield c
    finally:
        for ns in (worker_ns, head_ns):
            _kill_ns(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory):
    """The same job as a local two-process `accelerate launch` in a loopback-only namespace."""
    out = tmp_path_factory.mktemp("local")
    cmd = isolated([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    "accelerate_configs/zero3.yaml", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", "29537", "recipes/dpo.py", *RECIPE_ARGS, "--output_dir", str(out)])
    p = subprocess.run(cmd, cwd=REPO, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return _losses(out)


def _losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(output_dir) if "loss" in r}


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < 1e-5, f"largest step-loss difference {worst:.3g}: {got} vs {want}"


def _assert_nothing_left(cluster: Cluster, output_dir: str, wait_s: float = 15) -> None:
    deadline = time.time() + wait_s
    while (stray := _procs_with(output_dir)) and time.time() < deadline:
        time.sleep(0.5)
    assert not stray, "stray processes:\n" + "\n".join(stray)
    status = cluster.cli("status", "--address", DASHBOARD, timeout=60).stdout
    assert "placement groups: 0 not removed" in status, status


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_node_dpo_matches_local_run(cluster, local_losses, tmp_path):
    out = str(tmp_path / "ray")
    p = subprocess.run(cluster.run_cmd(out), cwd=REPO, env=_clean_env(), capture_output=True, text=True,
                       timeout=240)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "[node 0] " in log and "[node 1] " in log and "SUCCEEDED" in log
    assert f"--main_process_ip {HEAD_IP}" in log or f"--main_process_ip {WORKER_IP}" in log
    _assert_same_losses(_losses(out), local_losses)
    _assert_nothing_left(cluster, out)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_killed_node_fails_the_job_in_bound_then_resume_completes(cluster, local_losses, tmp_path):
    """Under accelerate_configs/fsdp2.yaml (the kit's fully_shard across the two nodes, torch distributed checkpoints
    of each node's shards): the killed job and its resume together give the local ZeRO-3 run's losses."""
    out = str(tmp_path / "ray")
    job = subprocess.Popen(cluster.run_cmd(out, config="fsdp2.yaml"), cwd=REPO, env=_clean_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 200
        while not os.path.isfile(f"{out}/checkpoint-6/trainer_state.json"):
            assert job.poll() is None, f"job ended early ({job.returncode}):\n{job.stdout.read()[-6000:]}"
            assert time.time() < deadline, "no checkpoint-6"
            time.sleep(0.1)
        mine = f"recipes/dpo.py {' '.join(RECIPE_ARGS)} --output_dir {out}"  # this job's, not another run's
        victims = [int(line.split(":")[0]) for line in _procs_with(mine)
                   if "accelerate" not in line and _env_of(int(line.split(":")[0])).get("RANK") == "1"]
        assert len(victims) == 1, _procs_with("recipes/dpo.py")
        os.kill(victims[0], signal.SIGKILL)  # node 1's training process dies mid-run
        killed = time.monotonic()
        log, _ = job.communicate(timeout=NODE_TIMEOUT_S + 60)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0, log[-6000:]
    assert took < NODE_TIMEOUT_S, f"job took {took:.1f}s to fail"
    assert "[cluster] error: node" in log and "FAILED" in log, log[-6000:]
    print(f"job failed {took:.1f}s after the kill")
    _assert_nothing_left(cluster, out)

    assert os.path.isfile(f"{out}/checkpoint-6/fsdp2_0/.metadata")
    p = subprocess.run(cluster.run_cmd(out, "--resume_from_checkpoint", "auto", config="fsdp2.yaml"), cwd=REPO,
                       env=_clean_env(), capture_output=True, text=True, timeout=240)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "resumed from" in log, log[-6000:]
    _assert_same_losses(_losses(out), local_losses)  # steps 1..k from the killed run, the rest from the resumed one
    _assert_nothing_left(cluster, out)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_grpo_with_its_rollout_server_placed_on_another_node(cluster, tiny_tied_path, tmp_path):
    """`run --rollout_servers 1`: the placement group puts the trainer (one process) on one node and the kit's vLLM
    server on the other; the job starts the server with its key and a certificate made for the job (TLS: the key
    never crosses the veth in clear), hands both to the recipe, and stops the server at the end.
    Every step's weight sync crosses the veth (the server's URL is the other node's address: streamed, over TLS with
    the trainer's own certificate, which the server's worker pins) and the probe
    holds (fp32 bound 1e-3; the probe also stops a run whose engine does not move with the trainer); GRPO learns the
    embedded task (grpo_tiny.yaml, 14 steps: the last 3 steps' mean reward at least twice the first 2 steps' and 0.1
    above, as the local HF run must); nothing is left on either node. On the tied tiny model (the output layer is the
    input embedding, as in SmolLM2): the server's side of the tied-layout sync (rollout/worker_extension.py), whose
    stale output layer gave probes of 0.07-0.13 before its fix."""
    import re

    out = str(tmp_path / "ray")
    cmd = ["ip", "netns", "exec", cluster.head_ns, sys.executable, "-m", "verl_kit.launch.cluster", "run",
           "--address", DASHBOARD, "--recipe", "recipes/grpo.py", "--config", "recipes/configs/grpo_tiny.yaml",
           "--nodes", "1", "--procs_per_node", "1", "--rollout_servers", "1", "--node_timeout_s",
           str(NODE_TIMEOUT_S), "--stop_grace_s", "5", "--accelerate_config", "accelerate_configs/single.yaml", "--",
           "--model_name_or_path", tiny_tied_path, "--max_steps", "14", "--logging_steps", "1", "--output_dir", out]
    p = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=450)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    trainer_ip = re.search(r"\[cluster\] node 0: \S+ (\S+) ", log).group(1)
    server_ip, url = re.search(r"\[cluster\] rollout server 0: \S+ (\S+): .* --port (\d+)", log).groups()
    assert {trainer_ip, server_ip} == {HEAD_IP, WORKER_IP}, log[-6000:]  # one role per node
    # over TLS: the job's certificate, which the trainer alone trusts (--vllm_server_ca_file)
    assert f"--vllm_server_url https://{server_ip}:{url} --vllm_server_ca_file .verl_kit/servers-ca.pem" in log, \
        log[-6000:]
    assert "[server 0] " in log and "--ssl_certfile" in log, log[-6000:]
    # the weights cross the veth over TLS too: the stream the server's worker pulls them from speaks it
    assert re.search(rf"weight sync: the engines pull buckets from https://{trainer_ip}:\d+ \(TLS", log), log[-6000:]
    rows = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert all(r["sync/bytes"] > 0 and r["rollout/logprob_max_abs_diff"] < 1e-3 for r in rows), rows
    rewards = [r["reward/mean"] for r in rows]
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"reward start {start:.3f} end {end:.3f}: {[round(x, 3) for x in rewards]}")
    assert end > 2 * start and end > start + 0.1, rewards
    _assert_nothing_left(cluster, out)
    assert not _procs_with(f"--port {url}"), _procs_with("vllm_server")  # the server stopped with the job


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_node_fails_the_job_by_heartbeat(cluster, tmp_path):
    """A node that stops answering (every process of the worker namespace SIGSTOPped: a hung machine or a cut
    network) fails the job after --node_timeout_s, although its peer just waits in a collective. When the node
    comes back, its raylet learns it was declared dead, its actor dies and the reaper kills the training processes.
    Runs last: the worker node does not survive it."""
    out, timeout_s = str(tmp_path / "ray"), 10
    job = subprocess.Popen(cluster.run_cmd(out, node_timeout_s=timeout_s), cwd=REPO, env=_clean_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    frozen: list[int] = []
    try:
        deadline = time.time() + 200
        while not os.path.isfile(f"{out}/checkpoint-3/trainer_state.json"):
            assert job.poll() is None, f"job ended early ({job.returncode}):\n{job.stdout.read()[-6000:]}"
            assert time.time() < deadline, "no checkpoint-3"
            time.sleep(0.1)
        frozen = _ns_pids(cluster.worker_ns)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        log, _ = job.communicate(timeout=timeout_s + 60)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert job.returncode != 0, log[-6000:]
    assert f"({WORKER_IP}) did not answer" in log, log[-6000:]
    assert took < timeout_s + 5 + 20, f"job took {took:.1f}s to fail"  # heartbeat + stop grace + teardown
    print(f"job failed {took:.1f}s after the node froze")
    _assert_nothing_left(cluster, out, wait_s=60)


def _env_of(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
