"""Nothing a run started outlives its training process, however that process dies. The scenario is a SIGKILL of the
trainer alone (an OOM kill, `kill -9 PID`): its process group and every process it started live on, no atexit or
finalizer runs. Within ORPHAN_BOUND_S of the kill no process the trainer had under it (by parent chain, collected just
before the kill) may remain, nothing may still map the run's weight-sync slots, and the slots (and vLLM's own
shared-memory queues) are removed. The processes are stopped by verl_kit.launch.processes.OrphanGuard.

The guard itself is tested here, on stand-ins. The colocated engine (`--rollout vllm`: vLLM's EngineCore and its
Worker, which vLLM starts as the trainer's child and grandchild) is tested where a run is killed anyway:
tests/recipes/test_grpo_runs.py::test_grpo_async_resume_bit_identical kills the trainer alone with
helpers.sigkill_alone_leaves_nothing before resuming it. The server a `--rollout vllm-server` run starts:
tests/rollout/test_vllm.py::test_server_started_by_a_run_dies_with_it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import ORPHAN_BOUND_S, REPO, alive, env

GUARD_DRIVER = r"""
import json, os, subprocess, sys, time
import psutil
from verl_kit.launch import processes
from verl_kit.rollout import transport


def with_child(proc):
    while not psutil.Process(proc.pid).children():
        time.sleep(0.01)
    return proc


processes._guard = guard = processes.OrphanGuard(grace_s=1.0,
                                                 files=(transport.slot_dir(), transport.SLOT_NAME.pattern))
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
parent = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)"]
with guard.watch("engine"):  # an engine core (a child) and its worker (a grandchild that ignores SIGTERM)
    core = with_child(subprocess.Popen(parent + stubborn))
with guard.watch("closed"):  # stopped normally (not really: it must be left alone all the same)
    closed = subprocess.Popen(sleep)
guard.forget("closed")
bystander = subprocess.Popen(sleep)  # not the guard's: left alone
server = with_child(subprocess.Popen(parent + sleep, start_new_session=True))  # a server and its worker: a group
guard.group("server", server.pid)
slot = os.path.join("/dev/shm", f"verl_kit-{os.getuid()}", f"{os.getpid()}-{'0' * 32}.safetensors")
os.makedirs(os.path.dirname(slot), mode=0o700, exist_ok=True)
open(slot, "w").close()
with guard.watch("starting"):  # killed while an engine starts: what the guard saw appear so far goes
    starting = with_child(subprocess.Popen(parent + sleep))
    time.sleep(1.2)  # the guard polls every 0.5 s while a watch is open
    worker = psutil.Process(core.pid).children()[0].pid
    while not int(next(x for x in open(f"/proc/{worker}/status") if x.startswith("SigIgn:")).split()[1], 16) >> 14 & 1:
        time.sleep(0.01)  # until the stubborn worker ignores SIGTERM
    print(json.dumps({"guard": guard.proc.pid, "keep": [closed.pid, bystander.pid], "slot": slot}), flush=True)
    time.sleep(600)
"""


def test_guard_stops_what_it_was_told_about_and_nothing_else(tmp_path):
    """The guard alone, on stand-ins (no vLLM): SIGKILL the process that started it; what appeared under it during
    `watch` (a child and a grandchild, which ignores SIGTERM: SIGKILLed after the grace; and another pair while a
    `watch` is still open) and the process group it was given go, with its slot file and the guard itself; a part
    `forget`-ten and a child it was never told about stay."""
    import json

    import psutil

    script = tmp_path / "driver.py"
    script.write_text(GUARD_DRIVER)
    log = tmp_path / "driver.log"
    with open(log, "w") as f:
        driver = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                  stderr=f, text=True, start_new_session=True)
    keep = []
    try:
        line = driver.stdout.readline()
        assert line, log.read_text()
        info = json.loads(line)
        tree = psutil.Process(driver.pid).children(recursive=True)
        keep = [p for p in tree if p.pid in info["keep"]]
        doomed = [p for p in tree if p.pid not in info["keep"]]
        assert len(doomed) == 7 and len(keep) == 2 and os.path.exists(info["slot"]), (tree, info)  # +guard
        os.kill(driver.pid, signal.SIGKILL)
        t0 = time.time()
        driver.wait()
        while alive(doomed) and time.time() - t0 < ORPHAN_BOUND_S:
            time.sleep(0.05)
        took = time.time() - t0
        assert not alive(doomed), alive(doomed)
        assert 1.0 <= took < ORPHAN_BOUND_S, took  # the stubborn one waited for the grace (1 s)
        assert len(alive(keep)) == 2 and not os.path.exists(info["slot"])
        assert f"trainer {driver.pid} is gone" in log.read_text()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        for p in alive(keep):
            p.kill()


GROUP_DRIVER = r"""
import json, multiprocessing as mp, os, sys
from verl_kit.launch import processes


def child(q, method):  # an engine core: it starts its worker (a grandchild)
    q.put(("child", os.getpid(), os.getpgid(0)))
    w = mp.get_context(method).Process(target=worker, args=(q,))
    w.start()
    w.join()


def worker(q):
    q.put(("worker", os.getpid(), os.getpgid(0)))


if __name__ == "__main__":
    out = {"me": os.getpgid(0)}
    for method in ("fork", "spawn"):  # vLLM forks on CPU and spawns once CUDA is initialized
        ctx = mp.get_context(method)
        q = ctx.Queue()
        with processes.own_process_group():
            inside = ctx.Process(target=child, args=(q, method))
            inside.start()
        after = ctx.Process(target=worker, args=(q,))
        after.start()
        for p in (inside, after):
            p.join()
        seen = sorted(q.get() for _ in range(3))
        out[method] = {"codes": [inside.exitcode, after.exitcode], "seen": seen, "pid": inside.pid}
    print(json.dumps(out))
"""


def test_processes_started_in_own_process_group_lead_their_own(tmp_path):
    """processes.own_process_group, which a colocated engine starts under: a process multiprocessing forks or spawns
    in the block leads a process group of its own (same pid: vLLM tracks it), its own children join that group, and
    a process started after the block stays in its parent's group. So a SIGTERM to the job's process group reaches the
    trainer and not its engine (the run: tests/recipes/test_grpo_runs.py::test_grpo_async_resume_bit_identical)."""
    import json

    script = tmp_path / "driver.py"
    script.write_text(GROUP_DRIVER)
    p = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=120, start_new_session=True)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for method in ("fork", "spawn"):
        r = out[method]
        assert r["codes"] == [0, 0], r
        (_, child, child_group), *workers = r["seen"]  # the grandchild and the process started after the block
        assert child == r["pid"] and child_group == child != out["me"], (method, r)
        assert sorted(group for _, _, group in workers) == sorted([child, out["me"]]), (method, r)


LEAK_DRIVER = r"""
import json, multiprocessing as mp, os, signal, sys
from multiprocessing import resource_tracker, shared_memory
import psutil
from verl_kit.launch import processes


def queue(ready):  # a child that creates a segment (registered with the tracker it shares) and dies without cleanup
    segment = shared_memory.SharedMemory(create=True, size=4096)  # mapped while this process lives
    ready.send(segment.name)
    signal.pause()


if __name__ == "__main__":
    resource_tracker.ensure_running()
    theirs, ours = mp.Pipe()
    child = mp.get_context(sys.argv[1]).Process(target=queue, args=(ours,))
    child.start()
    theirs.recv()
    named = processes.named_ipc([psutil.Process(child.pid)])
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    released = processes.release_leaked_ipc(named, [psutil.Process()]) if sys.argv[2] == "release" else []
    print(json.dumps([sorted(named), released, [p for p in named if os.path.exists(p)]]), flush=True)
"""


def test_shared_memory_of_a_killed_child_is_released_without_a_warning(tmp_path):
    """processes.release_leaked_ipc, which a colocated engine's close() calls: vLLM SIGKILLs an engine core slower to
    stop than its shutdown timeout, and the core's message queues (multiprocessing shared memory, registered with the
    resource tracker this process shares) outlive it; the tracker then unlinked them at this process's exit with a
    "leaked shared_memory objects" warning on its stderr (a CI run's async GRPO stop ended with it). Released, the
    segment is gone and the exit is silent; without the release (the control) the warning appears."""
    import json

    script = tmp_path / "driver.py"
    script.write_text(LEAK_DRIVER)
    for method in ("fork", "spawn"):
        for mode in ("release", "control"):
            p = subprocess.run([sys.executable, str(script), method, mode], cwd=REPO, env=env(), capture_output=True,
                               text=True, timeout=60)
            assert p.returncode == 0, p.stderr[-3000:]
            warned = "leaked shared_memory" in p.stderr
            named, released, left = json.loads(p.stdout.strip().splitlines()[-1])
            assert len(named) == 1 and named[0].startswith("/dev/shm/psm_"), (method, p.stdout)
            if mode == "release":
                assert released == named and not left and not warned, (method, p.stdout, p.stderr[-2000:])
            else:
                assert released == [] and left == named and warned, (method, p.stdout, p.stderr[-2000:])
