"""Multi-node runs on a Ray cluster: the recipe and accelerate config of a local run, launched once per node.

    python -m verl_kit.launch.cluster up                                    # local head on 127.0.0.1, dashboard :8265
    python -m verl_kit.launch.cluster up --node_ip HEAD_IP                  # a head other machines reach
    python -m verl_kit.launch.cluster up --address HEAD_IP:6379 --node_ip MY_IP   # join it (with the head's token)
    python -m verl_kit.launch.cluster run --recipe recipes/dpo.py --nodes 2 --procs_per_node 8 \\
        --accelerate_config accelerate_configs/zero3.yaml -- --output_dir /shared/runs/dpo
    python -m verl_kit.launch.cluster status | logs [--job_id ID] | stop [--job_id ID] | down

Ray schedules and supervises; torch.distributed (NCCL on GPU, gloo on CPU) does the collectives. `run` submits a Ray
job (the working directory travels with it) whose driver (`_driver` below) reserves one placement-group bundle per
node (STRICT_SPREAD), starts `accelerate launch --machine_rank i --main_process_ip <node 0> ...` on node i from an
actor pinned to bundle i, streams every node's output as `[node i] ...`, and ends the whole job as soon as one node
fails or stops answering for --node_timeout_s. The recipe never learns it runs on Ray.

Roles: with --rollout_servers N (an online recipe) the placement group also holds N rollout bundles, each on a node
of its own (apart from the trainer's; GPUs where the cluster has them). Before the trainer starts, the driver starts
the kit's vLLM server (`python -m verl_kit.rollout.vllm_server serve`, the run's --model_name_or_path) on each of
those nodes, on the node's address, with one fresh key for the job's servers, waits for their /health, and hands
them to the recipe: `--rollout vllm-server --vllm_server_url <their URLs>`, the key in the trainer's VLLM_API_KEY
(never on a command line, nor in the job's runtime_env). Each server runs under a reaper like a trainer's launch and
stops with the job; the weight sync streams across hosts (rollout.transport).

    python -m verl_kit.launch.cluster run --recipe recipes/grpo.py --nodes 1 --procs_per_node 8 --rollout_servers 2 \
        --accelerate_config accelerate_configs/zero3.yaml -- --output_dir /shared/runs/grpo

Nothing is left behind: each launch runs under a small reaper process (verl_kit.launch.processes.reap), detached
from its actor and a child subreaper, so it still owns the training processes torchrun starts in their own sessions;
it kills the whole tree when the launch ends, when it is told to stop, or when its actor dies (job stopped, driver
killed, raylet gone). The placement group is removed in a `finally`, and Ray removes it anyway when the job's driver
exits.

Secrets stay off the dashboard: the job's runtime_env (shown in clear by Ray) carries no variable named like a
credential (`job_env`); each node's launch reads its own from the environment its `cluster up` was started with.
`up` always runs Ray with its token auth, loopback included (`ensure_token_auth`: a head generates a token on first
use), and the clients here speak it.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from verl_kit.launch import processes

# Variables copied from the submitting shell to every node, so a cluster run behaves like the local one
# (NCCL/gloo interface choice, offline hub, caches, trackers). CUDA_VISIBLE_DEVICES is Ray's to set.
PASS_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "HF_", "TRANSFORMERS_", "WANDB_", "VERL_KIT_",
                     "DS_", "PYTORCH_", "FI_", "UCX_")
PASS_ENV_NAMES = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_LAUNCH_BLOCKING")
# Never copied, whatever the prefix: a name with one of these words (HF_TOKEN, WANDB_API_KEY, ...) holds a credential,
# and the job's runtime_env is shown in clear by Ray's dashboard and job API. Each node reads its own from the
# environment its `cluster up` was started with, or from the libraries' login files (docs/cluster.md).
SECRET_WORDS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH",
                          "COOKIE"})
WORKING_DIR_EXCLUDES = [".git", ".venv", "outputs", ".cache", "bench/results", "wandb", "**/__pycache__",
                        ".pytest_cache", ".ruff_cache"]
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


# ---- node side: one `accelerate launch` under its reaper (verl_kit.launch.processes.reap) ---------------------------

class NodeAgent:
    """Ray actor pinned to one placement-group bundle: starts the node's launch and hands its output to the driver."""

    def __init__(self, rank: int):
        self.rank = rank
        self.reaper_pid: int | None = None
        self.rc: int | None = None
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None
        self.private: list[str] = []

    def info(self) -> dict:
        import psutil
        import ray

        ip = ray.util.get_node_ip_address()
        ifname = next((name for name, addrs in psutil.net_if_addrs().items()
                       if any(a.family == socket.AF_INET and a.address == ip for a in addrs)), None)
        return {"ip": ip, "host": socket.gethostname(), "ifname": ifname, "pid": os.getpid(), "cwd": os.getcwd()}

    def free_port(self, ip: str) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def write_file(self, path: str, text: str, private: bool) -> str:
        """Write `text` on this node: `private` (a server's TLS key) into a fresh 0700 folder, mode 600, else at
        `path` relative to the job's working dir (the same on every node); returns the absolute path."""
        import tempfile

        if private:
            self.private.append(tempfile.mkdtemp(prefix="verl-kit-tls-"))
            path = os.path.join(self.private[-1], os.path.basename(path))
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return os.path.abspath(path)

    def remove_private(self) -> None:
        """Remove what write_file wrote privately (a server reads its TLS key at start)."""
        import shutil

        for folder in self.private:
            shutil.rmtree(folder, ignore_errors=True)
        self.private = []

    def start(self, cmd: list[str], env: dict, grace_s: float) -> int:
        """Start the reaper (which starts `cmd`); returns the reaper's pid."""
        proc = subprocess.Popen(processes.reaper_command(os.getpid(), cmd, grace_s), env={**os.environ, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        proc.wait()  # the first fork returns at once
        first = proc.stdout.readline().decode(errors="replace")
        if not first.startswith(f"{processes.REAPER_TAG} pid "):
            raise RuntimeError(f"node {self.rank}: the launch did not start: {first.strip()}")
        self.reaper_pid = int(first.split()[-1])
        self.reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.reader.start()
        return self.reaper_pid

    def _read(self, stream) -> None:
        for raw in stream:
            # progress bars redraw with \r: keep the last state of the line
            line = raw.decode(errors="replace").rstrip("\r\n").split("\r")[-1]
            if line.startswith(f"{processes.REAPER_TAG} exit "):
                self.rc = int(line.split()[-1])
                continue
            with self.lock:
                self.lines.append(line)
        if self.rc is None:
            self.rc = 137
            with self.lock:
                self.lines.append("[reaper] ended without an exit code (killed?)")

    def poll(self) -> tuple[list[str], int | None]:
        """New output lines and the exit code (None while running; set once all output was read)."""
        done = self.reader is not None and not self.reader.is_alive()
        with self.lock:  # after the check: once the reader is done, its last lines are already here
            lines, self.lines = self.lines, []
        return lines, (self.rc if done else None)

    def wait_healthy(self, url: str, key: str, ca_pem: str, timeout_s: float) -> None:
        """For a rollout server's launch: return once `url`/health answers 200 with the key, over TLS verified with
        `ca_pem`; raise if the launch ends first or timeout_s passes."""
        import ssl
        import urllib.error
        import urllib.request

        context = ssl.create_default_context(cadata=ca_pem)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.reader is not None and not self.reader.is_alive():
                raise RuntimeError(f"the server exited with {self.rc} while starting")
            try:
                req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {key}"})
                with urllib.request.urlopen(req, timeout=5, context=context) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server at {url} was not healthy after {timeout_s:.0f}s")
            time.sleep(1)

    def stop(self, grace_s: float) -> int | None:
        """Ask the reaper to end the launch; kill the whole tree if it has not after grace_s."""
        import psutil

        if self.reader is None or not self.reader.is_alive():
            return self.rc
        try:
            reaper = psutil.Process(self.reaper_pid)
            tree = [reaper, *reaper.children(recursive=True)]
            reaper.terminate()
        except psutil.NoSuchProcess:
            tree = []
        self.reader.join(grace_s + 5)
        if self.reader.is_alive():
            processes.kill_tree(tree, 1)
            self.reader.join(5)
        return self.rc


# ---- head side: the job driver ---------------------------------------------------------------------------------

def launch_command(args, rank: int, main_ip: str, port: int, ds_standard: bool) -> list[str]:
    """The `accelerate launch` command of node `rank`: the local command plus the multi-node fields."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
           "--num_machines", str(args.nodes), "--num_processes", str(args.nodes * args.procs_per_node),
           "--machine_rank", str(rank), "--main_process_ip", main_ip, "--main_process_port", str(port)]
    if ds_standard:  # accelerate defaults multi-node DeepSpeed to pdsh/ssh; Ray already placed us on every node
        cmd += ["--deepspeed_multinode_launcher", "standard"]
    cmd += shlex.split(args.launch_args or "") + [args.recipe]
    if args.config:
        cmd += ["--config", args.config]
    return cmd + list(args.recipe_args)


def _uses_deepspeed(config_file: str) -> bool:
    import yaml

    with open(config_file) as f:
        cfg = yaml.safe_load(f) or {}
    ds = cfg.get("deepspeed_config") or {}
    return cfg.get("distributed_type") == "DEEPSPEED" and "deepspeed_multinode_launcher" not in ds


def _say(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def _bundles(args) -> tuple[list[dict], list[int]]:
    """The placement group's bundles, the trainer's nodes first, then one per rollout server; the GPUs of each."""
    import ray

    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    gpus = args.gpus_per_node if args.gpus_per_node >= 0 else (args.procs_per_node if has_gpus else 0)
    server_gpus = args.gpus_per_server if args.gpus_per_server >= 0 else (1 if has_gpus else 0)
    trainer = {"CPU": args.cpus_per_node, **({"GPU": gpus} if gpus else {})}
    server = {"CPU": args.cpus_per_server, **({"GPU": server_gpus} if server_gpus else {})}
    return ([trainer] * args.nodes + [server] * args.rollout_servers,
            [gpus] * args.nodes + [server_gpus] * args.rollout_servers)


def _placed(args, pg, bundles: list[dict]) -> bool:
    """Wait for the placement group; False (after saying why) if the cluster cannot hold it in time."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(pg.ready(), timeout=args.placement_timeout_s)
        return True
    except GetTimeoutError:
        alive = [f"{n['NodeManagerAddress']} {n['Resources']}" for n in ray.nodes() if n["Alive"]]
        servers = f" + {args.rollout_servers} rollout server(s) x {bundles[-1]}" if args.rollout_servers else ""
        _say(f"error: could not place {args.nodes} trainer node(s) x {bundles[0]}{servers} (one bundle per node, "
             f"STRICT_SPREAD) within {args.placement_timeout_s}s; alive nodes: {alive or 'none'}")
        return False


def _add_agents(args, pg, bundles: list[dict], gpus: list[int], agents: list) -> None:
    """One NodeAgent per bundle, appended to `agents` as they are created so the caller can always clean them up."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    Agent = ray.remote(NodeAgent)
    for i, (bundle, n_gpus) in enumerate(zip(bundles, gpus)):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        agents.append(Agent.options(scheduling_strategy=strategy, num_cpus=bundle["CPU"], num_gpus=n_gpus,
                                    max_concurrency=4, name=None).remote(i))


def _node_env(args, info: dict) -> tuple[dict, list[str]]:
    """The extra environment of one node's launch, and its GLOO/NCCL socket interfaces as chosen."""
    env = {"PYTHONUNBUFFERED": "1", "VERL_KIT_NO_BAR": os.environ.get("VERL_KIT_NO_BAR", "1")}
    # Sockets go over the interface that carries this node's Ray address unless the user chose one; a
    # loopback choice (fine for one-node tests) cannot reach other nodes, so it yields too.
    chosen = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(var)
        if info["ifname"] and (not value or (value == "lo" and args.nodes + args.rollout_servers > 1)):
            env[var] = value = info["ifname"]
        chosen.append(str(value))
    return env, chosen


def recipe_value(args, name: str) -> str | None:
    """The value of the recipe's --<name> in the job's recipe arguments, else in its --config yaml, else its default
    (TrainConfig's; None for a flag it does not have)."""
    rargs = list(args.recipe_args)
    for k, a in enumerate(rargs):
        if a == f"--{name}" and k + 1 < len(rargs):
            return rargs[k + 1]
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    if args.config:
        import yaml

        with open(args.config) as f:
            value = (yaml.safe_load(f) or {}).get(name)
        if value is not None:
            return str(value)
    from verl_kit.config import TrainConfig  # a documented lazy load: the CLI and the job driver run without torch

    value = getattr(TrainConfig, name, None)
    return None if value is None else str(value)


SERVERS_CA = ".verl_kit/servers-ca.pem"  # on each trainer node, in the job's working dir: the servers' certificate


def server_command(args, ip: str, port: int, tls: tuple[str, str]) -> list[str]:
    """The command of one rollout server: the kit's vLLM server (what `make vllm-serve` runs) serving the run's
    initial policy on the node's address over TLS (`tls`: its certificate and key files on that node); its key
    comes in VLLM_API_KEY."""
    return [sys.executable, "-m", "verl_kit.rollout.vllm_server", "serve", "--model",
            recipe_value(args, "model_name_or_path"), "--host", ip, "--port", str(port), "--ssl_certfile", tls[0],
            "--ssl_keyfile", tls[1], *shlex.split(args.server_args or "")]


def job_certificate(ips: list[str]) -> tuple[str, str]:
    """A self-signed certificate for the job's server addresses and its key, as PEM text (made in a private temporary
    folder, removed at once): the servers speak TLS with it and the trainer trusts it alone."""
    import shutil
    import tempfile

    from verl_kit.rollout.vllm_server import self_signed_certificate

    folder = tempfile.mkdtemp(prefix="verl-kit-tls-")
    try:
        paths = self_signed_certificate(ips, folder)
        return tuple(open(p).read() for p in paths)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start_servers(args, agents: list, key: str) -> tuple[list[dict], str]:
    """Start the rollout servers, one on each of their bundles' nodes, all with the job's key and one certificate
    made for the job (TLS: the key never crosses the network in clear); wait until each answers /health. Hands
    their URLs to the trainer (the recipe's --rollout vllm-server --vllm_server_url, --vllm_server_ca_file).
    Returns each server node's info() and the certificate (PEM) the trainer nodes write to SERVERS_CA."""
    import ray

    infos = ray.get([a.info.remote() for a in agents], timeout=args.placement_timeout_s)
    cert, tls_key = job_certificate(sorted({info["ip"] for info in infos}))
    urls = []
    for j, (agent, info) in enumerate(zip(agents, infos)):
        port = ray.get(agent.free_port.remote(info["ip"]), timeout=60)
        files = ray.get([agent.write_file.remote("cert.pem", cert, True),
                         agent.write_file.remote("key.pem", tls_key, True)], timeout=60)
        cmd = server_command(args, info["ip"], port, tuple(files))
        urls.append(f"https://{info['ip']}:{port}")
        _say(f"rollout server {j}: {info['host']} {info['ip']}: {shlex.join(cmd[1:])}")
        ray.get(agent.start.remote(cmd, {"PYTHONUNBUFFERED": "1", "VLLM_API_KEY": key}, args.stop_grace_s),
                timeout=60)
    ray.get([a.wait_healthy.remote(url, key, cert, args.server_timeout_s) for a, url in zip(agents, urls)],
            timeout=args.server_timeout_s + 60)
    ray.get([a.remove_private.remote() for a in agents], timeout=60)
    _say(f"rollout servers ready: {', '.join(urls)}")
    args.recipe_args += ["--rollout", "vllm-server", "--vllm_server_url", ",".join(urls),
                         "--vllm_server_ca_file", SERVERS_CA]
    return infos, cert


def _start_nodes(args, agents: list, key: str | None, cert: str | None) -> list[dict]:
    """Start `accelerate launch` on every trainer node, rendezvousing on node 0 (with the rollout servers' key in
    VLLM_API_KEY and their certificate in SERVERS_CA when the job placed servers); returns each node's info()."""
    import ray

    infos = ray.get([a.info.remote() for a in agents], timeout=args.placement_timeout_s)
    main_ip = infos[0]["ip"]
    port = args.main_process_port or ray.get(agents[0].free_port.remote(main_ip), timeout=60)
    ds_standard = args.nodes > 1 and _uses_deepspeed(args.accelerate_config)
    for i, (agent, info) in enumerate(zip(agents, infos)):
        env, chosen = _node_env(args, info)
        if key:
            env["VLLM_API_KEY"] = key
        if cert:
            ray.get(agent.write_file.remote(SERVERS_CA, cert, False), timeout=60)
        cmd = launch_command(args, i, main_ip, port, ds_standard)
        _say(f"node {i}: {info['host']} {info['ip']} (GLOO/NCCL_SOCKET_IFNAME={'/'.join(chosen)}): "
             f"{shlex.join(cmd[1:])}")
        ray.get(agent.start.remote(cmd, env, args.stop_grace_s), timeout=60)
    return infos


def _label(args, i: int) -> str:
    return f"node {i}" if i < args.nodes else f"server {i - args.nodes}"


def _supervise(args, agents: list, infos: list[dict], lost: set[int]) -> tuple[dict[int, str], list, bool]:
    """Stream every launch's output as `[node i] ...` (a rollout server's as `[server j] ...`) until every trainer
    node's launch ended, or a second after the first failure.

    Returns (node -> why it failed, in the order seen; each node's last --error_lines lines; whether every trainer
    node ended). Nodes whose actor died or stopped answering for --node_timeout_s are added to `lost` as they are
    found. A rollout server that ends is reported, not failed: the trainer's router drops it, or stops the run when
    none is left."""
    import ray
    from ray.exceptions import RayActorError

    failed: dict[int, str] = {}
    done: set[int] = set()
    trainers = set(range(args.nodes))
    tails = [collections.deque(maxlen=args.error_lines) for _ in agents]
    last_seen = [time.monotonic()] * len(agents)
    settle_until = None  # after the first failure, a second to hear from peers that fail with it
    while not trainers <= done and (settle_until is None or time.monotonic() < settle_until):
        live = [i for i in range(len(agents)) if i not in done]
        refs = {agents[i].poll.remote(): i for i in live}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=args.node_timeout_s)
        now = time.monotonic()
        for ref in ready:
            i = refs[ref]
            try:
                lines, rc = ray.get(ref)
            except RayActorError as e:
                done.add(i)
                lost.add(i)
                why = (f"{_label(args, i)} ({infos[i]['ip']}) lost: its Ray actor died "
                       f"({type(e).__name__}: {str(e).splitlines()[0]})")
                if i in trainers:
                    failed[i] = why
                else:
                    _say(why)
                continue
            last_seen[i] = now
            for line in lines:
                print(f"[{_label(args, i)}] {line}", flush=True)
                tails[i].append(line)
            if rc is not None:
                done.add(i)
                if i not in trainers:
                    _say(f"rollout server {i - args.nodes} ({infos[i]['ip']}) exited with code {rc}")
                elif rc != 0:
                    failed[i] = f"node {i} ({infos[i]['ip']}) failed with exit code {rc}"
        for i in live:
            if i not in done and now - last_seen[i] >= args.node_timeout_s:
                done.add(i)
                lost.add(i)
                why = (f"{_label(args, i)} ({infos[i]['ip']}) did not answer for {args.node_timeout_s:.0f}s "
                       "(node lost or unreachable)")
                if i in trainers:
                    failed[i] = why
                else:
                    _say(why)
        if failed and settle_until is None:
            settle_until = now + 1.0
        time.sleep(args.poll_s)
    return failed, tails, trainers <= done


def _report(nodes: int, failed: dict[int, str], tails: list, all_ended: bool) -> int:
    """Say how the run ended, repeating the last lines of each failed node; the job's exit code."""
    if not failed:
        _say(f"all {nodes} nodes finished")
        return 0
    for i in failed:
        if tails[i]:
            _say(f"last {len(tails[i])} lines of node {i}:")
            for line in tails[i]:
                print(f"[node {i}] {line}", flush=True)
    _say("error: " + "; ".join(failed.values()) + ("" if all_ended else "; stopping the other nodes"))
    return 1


def _cleanup(args, pg, agents: list, lost: set[int]) -> None:
    """Stop every launch that can still be asked to, kill the actors, free the placement group, leave Ray."""
    import ray
    from ray.util.placement_group import remove_placement_group

    stops = [a.stop.remote(args.stop_grace_s) for i, a in enumerate(agents) if i not in lost]
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=args.stop_grace_s + 10)
    for a in agents:
        ray.kill(a)
    if pg is not None:
        remove_placement_group(pg)
    ray.shutdown()


def drive(args) -> int:
    """Job entrypoint on the head node. Returns 0 when every node's launch exits 0, else 1."""
    import ray
    from ray.util.placement_group import placement_group

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `ray job stop`: run the finally below
    ray.init(log_to_driver=False)
    bundles, gpus = _bundles(args)
    key = secrets.token_urlsafe(32) if args.rollout_servers else None  # the job's servers' key: never printed
    pg, agents = None, []
    lost: set[int] = set()  # nodes that cannot be asked to stop: their actor died or stopped answering
    try:
        pg = placement_group(bundles, strategy="STRICT_SPREAD", name=f"verl-kit-{os.getpid()}")
        if not _placed(args, pg, bundles):
            return 1
        _add_agents(args, pg, bundles, gpus, agents)
        server_infos, cert = _start_servers(args, agents[args.nodes:], key) if args.rollout_servers else ([], None)
        infos = _start_nodes(args, agents[:args.nodes], key, cert) + server_infos
        failed, tails, all_ended = _supervise(args, agents, infos, lost)
        return _report(args.nodes, failed, tails, all_ended)
    finally:
        _cleanup(args, pg, agents, lost)


# ---- client side: up, run, status, logs, stop, down -------------------------------------------------------------

def _ray_bin() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    return exe if os.path.exists(exe) else "ray"


def job_env(environ) -> tuple[dict, list[str]]:
    """The variables a job carries to every node in its runtime_env (which Ray's dashboard shows), and the names of
    the secrets left out of it: those with a SECRET_WORDS word among their `_`-separated parts."""
    passed = {k: v for k, v in environ.items() if k.startswith(PASS_ENV_PREFIXES) or k in PASS_ENV_NAMES}
    withheld = sorted(k for k in passed if not SECRET_WORDS.isdisjoint(k.upper().split("_")))
    return {k: v for k, v in passed.items() if k not in withheld}, withheld


def token_path(environ) -> str:
    """Where Ray reads its auth token when RAY_AUTH_TOKEN is not set: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def ensure_token_auth(args, environ) -> None:
    """Every `up` runs Ray with its token auth, on loopback too (without it any local user, or any machine that
    reaches a routable head, submits jobs that run as this user): RAY_AUTH_MODE=token (set in `environ` when unset;
    `disabled` is refused) and a token, from RAY_AUTH_TOKEN or the token file, which other users must not read. A
    head with no token generates one into the token file (mode 600; copy it to every node and every machine that
    submits); a joining node must already have the head's. Exits with one line."""
    where = args.node_ip
    mode = environ.get("RAY_AUTH_MODE", "").lower()
    if mode not in ("", "token"):
        raise SystemExit(f"error: cluster up on {where}: RAY_AUTH_MODE={environ['RAY_AUTH_MODE']} is refused: the "
                         "kit's Ray cluster always runs with token auth (anyone who reaches it runs code as you "
                         "otherwise); unset RAY_AUTH_MODE")
    environ["RAY_AUTH_MODE"] = "token"
    if environ.get("RAY_AUTH_TOKEN"):
        return
    path = token_path(environ)
    if not os.path.exists(path):
        if args.address:
            raise SystemExit(f"error: cluster up on {where}: joining {args.address} needs the head's Ray token, "
                             f"and there is none in RAY_AUTH_TOKEN or {path}: copy the head's token file there (mode "
                             "600), or export RAY_AUTH_TOKEN")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        print(f"[cluster] generated Ray's auth token in {path} (mode 600): every node that joins and every machine "
              "that submits needs it (copy the file, or export RAY_AUTH_TOKEN)", flush=True)
        return
    mode_bits = os.stat(path).st_mode
    if mode_bits & 0o077:
        raise SystemExit(f"error: cluster up on {where}: the Ray token {path} is readable by other users "
                         f"(mode {oct(mode_bits & 0o777)}): chmod 600 {shlex.quote(path)}")


def use_token_auth(environ) -> None:
    """A client of the kit's cluster (run, status, logs, stop) speaks token auth: RAY_AUTH_MODE=token unless set."""
    environ.setdefault("RAY_AUTH_MODE", "token")


def up(args) -> int:
    ensure_token_auth(args, os.environ)
    cmd = [_ray_bin(), "start", "--node-ip-address", args.node_ip, "--disable-usage-stats"]
    if args.address:
        cmd += ["--address", args.address]
    else:
        cmd += ["--head", "--port", str(args.port), "--dashboard-host", args.dashboard_host or args.node_ip,
                "--dashboard-port", str(args.dashboard_port), "--include-dashboard=true"]
    if args.num_cpus is not None:
        cmd += ["--num-cpus", str(args.num_cpus)]
    if args.num_gpus is not None:
        cmd += ["--num-gpus", str(args.num_gpus)]
    if args.temp_dir:
        cmd += ["--temp-dir", args.temp_dir]
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd)


def _output_dir(args) -> str:
    """The run's --output_dir as an absolute path: nodes run in copies of the working dir, so a relative path would
    land in a different temporary directory on each node. It must be on storage every node sees. The recipe's flags
    end with it, made absolute."""
    path = os.path.abspath(recipe_value(args, "output_dir"))
    rargs = list(args.recipe_args)
    for k, a in enumerate(rargs):
        if a == "--output_dir" and k + 1 < len(rargs):
            del rargs[k:k + 2]
            break
        if a.startswith("--output_dir="):
            del rargs[k]
            break
    args.recipe_args = rargs + ["--output_dir", path]
    return path


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as e:
        why = str(e).splitlines()[0][:200]
        raise SystemExit(f"error: cannot reach the Ray job API at {address} ({why}); is the cluster up "
                         "(make cluster-up)? From another machine pass DASHBOARD=http://HEAD_IP:8265") from None



def _latest_job(client, running_only: bool = False) -> str:
    jobs = [j for j in client.list_jobs() if j.submission_id and (not running_only or not j.status.is_terminal())]
    if not jobs:
        raise SystemExit("error: no " + ("running " if running_only else "") + "jobs on this cluster")
    return max(jobs, key=lambda j: j.start_time or 0).submission_id


def follow(client, job_id: str) -> int:
    """Print the job's log as it grows; exit code 0 if the job succeeded."""
    import asyncio

    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        print(f"\n[cluster] interrupted: stopping job {job_id}", flush=True)
        client.stop_job(job_id)
        return 130
    status = client.get_job_status(job_id)
    while not status.is_terminal():
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    print(f"[cluster] job {job_id}: {status.value}", flush=True)
    return 0 if status.value == "SUCCEEDED" else 1


def run(args) -> int:
    for flag, path in (("--recipe", args.recipe), ("--accelerate_config", args.accelerate_config),
                       ("--config", args.config)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"error: {flag}: no such file {path!r} (paths are relative to the working dir)")
    out = _output_dir(args)
    env, withheld = job_env(os.environ)
    if withheld:
        print(f"[cluster] not sent to the nodes (secrets): {', '.join(withheld)}; each node reads its own from the "
              "environment its `cluster up` started with (docs/cluster.md)", flush=True)
    driver = [args.python, "-m", "verl_kit.launch.cluster", "_driver", "--recipe", args.recipe,
              "--nodes", str(args.nodes),
              "--procs_per_node", str(args.procs_per_node), "--accelerate_config", args.accelerate_config,
              "--cpus_per_node", str(args.cpus_per_node), "--gpus_per_node", str(args.gpus_per_node),
              "--node_timeout_s", str(args.node_timeout_s), "--placement_timeout_s", str(args.placement_timeout_s),
              "--stop_grace_s", str(args.stop_grace_s), "--main_process_port", str(args.main_process_port),
              "--launch_args", args.launch_args or "", "--rollout_servers", str(args.rollout_servers),
              "--cpus_per_server", str(args.cpus_per_server), "--gpus_per_server", str(args.gpus_per_server),
              f"--server_args={args.server_args or ''}", "--server_timeout_s", str(args.server_timeout_s)]
    if args.config:
        driver += ["--config", args.config]
    entrypoint = shlex.join(driver + ["--", *args.recipe_args])
    client = _client(args.address)
    job_id = client.submit_job(
        entrypoint=entrypoint, submission_id=args.job_id or f"verl-kit-{time.strftime('%Y%m%d-%H%M%S')}",
        runtime_env={"working_dir": args.working_dir, "excludes": WORKING_DIR_EXCLUDES, "env_vars": env})
    servers = f" + {args.rollout_servers} rollout server(s) on nodes of their own" if args.rollout_servers else ""
    print(f"[cluster] submitted job {job_id} to {args.address}: {args.nodes} node(s) x {args.procs_per_node} "
          f"process(es){servers}; output_dir {out} must be on storage every node sees", flush=True)
    if args.detach:
        print(f"[cluster] follow: python -m verl_kit.launch.cluster logs --job_id {job_id} --follow", flush=True)
        return 0
    return follow(client, job_id)


def status(args) -> int:
    from ray.util.state import list_nodes, list_placement_groups

    client = _client(args.address)
    nodes = list_nodes(address=args.address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    print(f"nodes: {len(nodes)} alive")
    for n in nodes:
        res = ", ".join(f"{k} {v:g}" for k, v in sorted(n.resources_total.items()) if k in ("CPU", "GPU"))
        print(f"  {n.node_ip}{' (head)' if n.is_head_node else ''}: {res}")
    pgs = [p for p in list_placement_groups(address=args.address, raise_on_missing_output=False)
           if p.state != "REMOVED"]
    print(f"placement groups: {len(pgs)} not removed" + "".join(f"\n  {p.placement_group_id} {p.name} {p.state}"
                                                                 for p in pgs))
    jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    print(f"jobs: {len(jobs)}" + "".join(f"\n  {j.submission_id} {j.status.value}" for j in jobs))
    return 0


def logs(args) -> int:
    client = _client(args.address)
    job_id = args.job_id or _latest_job(client)
    if args.follow:
        return follow(client, job_id)
    print(client.get_job_logs(job_id), end="")
    return 0


def stop(args) -> int:
    client = _client(args.address)
    job_id = args.job_id or _latest_job(client, running_only=True)
    client.stop_job(job_id)
    deadline = time.monotonic() + args.wait_s
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"[cluster] job {job_id}: {client.get_job_status(job_id).value}")
    return 0


def down(args) -> int:
    """`ray stop`: ends every Ray process of this user on this machine (run it on each node)."""
    return subprocess.call([_ray_bin(), "stop"] + (["--force"] if args.force else []))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_args: list[str] = []
    if "--" in argv:  # everything after `--` goes to the recipe untouched
        k = argv.index("--")
        argv, recipe_args = argv[:k], argv[k + 1:]
    env_address = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_DASHBOARD_ADDRESS")
    p = argparse.ArgumentParser(prog="python -m verl_kit.launch.cluster", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("up", help="start a Ray head (default: local, on 127.0.0.1) or join one (--address)")
    s.add_argument("--address", default=None, help="HEAD_IP:PORT of a head to join; empty starts a head")
    s.add_argument("--node_ip", default="127.0.0.1", help="this node's address (what the other nodes reach)")
    s.add_argument("--port", type=int, default=6379, help="head: GCS port")
    s.add_argument("--dashboard_host", default=None, help="head: dashboard bind address (default: --node_ip)")
    s.add_argument("--dashboard_port", type=int, default=8265, help="head: dashboard and job API port")
    s.add_argument("--num_cpus", type=int, default=None, help="CPUs Ray may schedule on this node")
    s.add_argument("--num_gpus", type=int, default=None, help="GPUs Ray may schedule on this node")
    s.add_argument("--temp_dir", default=None, help="Ray's session/log directory (default /tmp/ray)")

    def add_address(s):
        s.add_argument("--address", default=env_address or DEFAULT_DASHBOARD,
                       help="dashboard (job API) URL of the head; env RAY_API_SERVER_ADDRESS")

    def add_run_args(s, driver: bool):
        s.add_argument("--recipe", default="recipes/dpo.py", help="recipe script, relative to the working dir")
        s.add_argument("--config", default=None, help="recipe yaml config passed as --config")
        s.add_argument("--nodes", type=int, default=1, help="nodes; one placement-group bundle each")
        s.add_argument("--procs_per_node", type=int, default=1, help="training processes per node (GPUs per node)")
        s.add_argument("--accelerate_config", default="accelerate_configs/zero3.yaml", help="accelerate yaml")
        s.add_argument("--launch_args", default="", help="extra `accelerate launch` flags, e.g. '--cpu'")
        s.add_argument("--cpus_per_node", type=float, default=1, help="CPUs reserved per node bundle")
        s.add_argument("--gpus_per_node", type=int, default=-1,
                       help="GPUs reserved per node bundle; -1: procs_per_node if the cluster has GPUs, else 0")
        s.add_argument("--node_timeout_s", type=float, default=60,
                       help="a node that does not answer for this long fails the job")
        s.add_argument("--placement_timeout_s", type=float, default=300, help="wait this long for the nodes")
        s.add_argument("--stop_grace_s", type=float, default=10, help="SIGTERM-to-SIGKILL grace when stopping a node")
        s.add_argument("--main_process_port", type=int, default=0, help="rendezvous port on node 0; 0: a free one")
        s.add_argument("--rollout_servers", type=int, default=0,
                       help="vLLM servers the job places on nodes of their own (one bundle each, apart from the "
                            "trainer's nodes), starts with a fresh key, hands to the recipe as --rollout vllm-server "
                            "--vllm_server_url and stops with the job; 0: none (the recipe's own --rollout)")
        s.add_argument("--cpus_per_server", type=float, default=1, help="CPUs reserved per rollout-server bundle")
        s.add_argument("--gpus_per_server", type=int, default=-1,
                       help="GPUs reserved per rollout-server bundle; -1: 1 if the cluster has GPUs, else 0")
        s.add_argument("--server_args", default="--dtype float32",
                       help="extra `python -m verl_kit.rollout.vllm_server serve` flags; the dtype must be the "
                            "run's rollout dtype (bf16 runs: '--dtype bfloat16')")
        s.add_argument("--server_timeout_s", type=float, default=600, help="wait this long for each server's /health")
        if driver:
            s.add_argument("--poll_s", type=float, default=0.5, help="log/heartbeat poll interval")
            s.add_argument("--error_lines", type=int, default=40, help="lines of a failed node's output to repeat")
        else:
            add_address(s)
            s.add_argument("--working_dir", default=".", help="directory shipped to every node (cwd of the run)")
            s.add_argument("--python", default=sys.executable, help="python on the cluster nodes (same path on each)")
            s.add_argument("--job_id", default=None, help="submission id (default verl-kit-<time>)")
            s.add_argument("--detach", action="store_true", help="submit and return without following the logs")

    add_run_args(sub.add_parser("run", help="submit a recipe as a Ray job; extra recipe flags after --"), False)
    add_run_args(sub.add_parser("_driver", help=argparse.SUPPRESS), True)
    add_address(sub.add_parser("status", help="nodes, placement groups and jobs"))
    s = sub.add_parser("logs", help="a job's log (default: the latest job)")
    add_address(s)
    s.add_argument("--job_id", default=None)
    s.add_argument("--follow", action="store_true")
    s = sub.add_parser("stop", help="stop a job (default: the latest running job)")
    add_address(s)
    s.add_argument("--job_id", default=None)
    s.add_argument("--wait_s", type=float, default=60)
    s = sub.add_parser("down", help="stop every Ray process of this user on this machine")
    s.add_argument("--force", action="store_true")

    args = p.parse_args(argv)
    args.recipe_args = recipe_args
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "_driver":
        return drive(args)
    if args.command in ("run", "status", "logs", "stop"):
        use_token_auth(os.environ)
    return {"up": up, "run": run, "status": status, "logs": logs, "stop": stop, "down": down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
