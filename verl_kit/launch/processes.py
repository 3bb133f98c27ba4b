"""Process supervision: whatever a run starts stops with it, however the run ends (SIGKILL and the OOM killer included,
when no atexit or finalizer runs). One module for the two supervisors, both run from this file by path:

    python -I verl_kit/launch/processes.py guard OWNER_PID GRACE_S [FOLDER PATTERN]   # started by OrphanGuard
    python verl_kit/launch/processes.py reap --parent PID --grace_s S -- CMD...       # started by launch.cluster

The orphan guard (`OrphanGuard`, one per training process: `orphan_guard()`) stops what a training process started (a
colocated vLLM engine's core and workers, a vLLM server's process group: `GuardedGroup`) when that process dies. The
reaper (`reap`) runs one node's `accelerate launch` of a Ray job and takes every descendant down with it. Both act
on psutil handles (never on a pid another process took over) and share `kill_tree`. The file imports only the standard
library and psutil, so the guard runs isolated (`-I`) in a small interpreter (~14 MB: no torch, nothing of the kit).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

import psutil

logger = logging.getLogger(__name__)


# ---- what both supervisors do to processes ------------------------------------------------------------------------

def descendants(pid: int | None = None) -> list:
    """psutil handles of every process under `pid` (default: this one), by parent chain; [] if it is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list:
    """The live processes of process group `pgid`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def ignores_sigterm(p) -> bool:
    try:
        with open(f"/proc/{p.pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
        return bool(mask >> (signal.SIGTERM - 1) & 1)
    except (OSError, StopIteration, ValueError):
        return False


def send(procs: list, pgids: list[int], sig: int) -> None:
    """`sig` to each process (a psutil handle: never a process that took a recorded pid over) and process group."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
    for g in pgids:
        try:
            os.killpg(g, sig)
        except OSError:
            pass


def wait_gone(procs: list, pgids: list[int], seconds: float) -> tuple[list, list[int]]:
    """Wait up to `seconds` for the processes and process groups to be gone; returns those still there."""
    deadline = time.time() + seconds
    while True:
        procs, pgids = [p for p in procs if alive(p)], [g for g in pgids if group_members(g)]
        if not (procs or pgids) or time.time() >= deadline:
            return procs, pgids
        time.sleep(0.1)


def kill_tree(procs: list, grace_s: float) -> None:
    """SIGTERM every process, wait up to grace_s, SIGKILL the survivors."""
    send(procs, [], signal.SIGTERM)
    left, _ = wait_gone(procs, [], grace_s)
    send(left, [], signal.SIGKILL)
    wait_gone(left, [], 5.0)


# ---- what a killed process leaves of multiprocessing's named objects ------------------------------------------------

_NAMED = {"psm_": "shared_memory", "sem.mp-": "semaphore"}  # /dev/shm/<prefix>...: SharedMemory, a spawned SemLock


def named_ipc(procs: list) -> set[str]:
    """The /dev/shm paths of multiprocessing's shared memory and semaphores that these processes map."""
    out = set()
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:
                    path = (line.split(maxsplit=5)[5:] or [""])[0].strip().removesuffix(" (deleted)")
                    if path.startswith("/dev/shm/") and os.path.basename(path).startswith(tuple(_NAMED)):
                        out.add(path)
        except OSError:
            pass
    return out


def release_leaked_ipc(paths: set[str], procs: list) -> list[str]:
    """Unlink those of `paths` (named_ipc of `procs`, taken while they ran) that outlived them and no live one of them
    maps: their creator was killed before its own cleanup (vLLM SIGKILLs an engine core that takes longer than its
    shutdown timeout). Each is also taken off multiprocessing's resource tracker, which this process shares with the
    processes it started (call `resource_tracker.ensure_running()` before starting them) and which would otherwise
    unlink it at this process's exit with a "leaked shared_memory objects" warning. Objects this process maps are its
    own and left alone. Returns the paths released."""
    import _multiprocessing
    from multiprocessing import resource_tracker

    keep = named_ipc([p for p in procs if alive(p)]) | named_ipc([psutil.Process()])
    released = []
    for path in sorted(paths - keep):
        name = os.path.basename(path)
        kind = next(k for prefix, k in _NAMED.items() if name.startswith(prefix))
        tracked = "/" + name.removeprefix("sem.")  # the name its creator registered
        try:
            if kind == "semaphore":
                _multiprocessing.sem_unlink(tracked)
            else:
                os.unlink(path)
        except OSError:
            continue  # its creator did unlink it (after we looked), and took it off the tracker itself
        resource_tracker.unregister(tracked, kind)
        released.append(path)
    return released


# ---- the orphan guard: the training process's side -----------------------------------------------------------------

class OrphanGuard:
    """Stops what this process started when this process dies, even by SIGKILL, when no finalizer runs. vLLM starts a
    colocated engine's core as a child of this process and the workers as the core's children, and nothing in them
    watches this process: a killed trainer left them running, reparented to PID 1, with their memory (and, on a GPU,
    their CUDA contexts). A parent-death signal (PR_SET_PDEATHSIG) can only be asked for by the child itself, so one
    small process (the guard, `Guard` below, run from this file) watches this one through a pidfd; when it is gone,
    the guard SIGKILLs the processes it was told about (a process that ignores SIGTERM, multiprocessing's resource
    tracker, and a process group, which the kernel SIGTERMs through its leader's parent-death signal, get `grace_s`
    seconds to go by themselves first), removes this process's `files` and exits. `files`: (folder, regex) whose
    matches, the writer's pid as group 1, are this process's (the weight-sync slots, verl_kit.rollout.transport).

    It acts on nothing else: on the processes that appeared under this one (by parent chain) while an engine started
    (`watch`), on process groups (`group`), and not on a part stopped normally (`forget`). It runs in a session of
    its own (a Ctrl-C or a kill of this process's group does not stop it first) and lives exactly as long as this
    process. One per process (`orphan_guard()`): with several training processes, each guards its own."""

    def __init__(self, grace_s: float = 5.0, files: tuple[str, str] | None = None):
        self.owner = os.getpid()
        cmd = [sys.executable, "-I", os.path.abspath(__file__), "guard", str(self.owner), str(grace_s), *(files or ())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        self._lock = threading.Lock()
        self._warned = False

    def _send(self, *words) -> None:
        with self._lock:
            try:
                self.proc.stdin.write((" ".join(map(str, words)) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                if not self._warned:
                    self._warned = True
                    logger.warning("the orphan guard (pid %d) is gone: a killed run may leave processes behind",
                                   self.proc.pid)

    @contextlib.contextmanager
    def watch(self, key: str):
        """The processes that appear under this one while the block runs (an engine's, by parent chain) are `key`'s.
        The guard also polls while it runs, so a kill during a long engine start is covered too."""
        before = {p.pid for p in descendants()}
        self._send("watch", key, *before)
        try:
            yield
        finally:
            self._send("settle", key, *({p.pid for p in descendants()} - before - {self.proc.pid}))

    def group(self, key: str, pgid: int) -> None:
        """Process group `pgid` (a process started in a session of its own, with everything it starts) is `key`'s."""
        self._send("group", key, pgid)

    def forget(self, key: str) -> None:
        self._send("forget", key)


_guard: OrphanGuard | None = None
_guard_lock = threading.Lock()


def orphan_guard(files: tuple[str, str] | None = None) -> OrphanGuard:
    """This process's guard, started on first use (with `files`: every caller in a process passes the same)."""
    global _guard
    with _guard_lock:
        if _guard is None or _guard.owner != os.getpid():  # not a guard inherited through a fork
            _guard = OrphanGuard(files=files)
        return _guard


def _terminate_with_parent() -> None:
    """In a child process before exec (Linux): SIGTERM it when the process that started it dies, even by SIGKILL, when
    atexit and `stop()` never run."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class GuardedGroup:
    """`cmd` started in a session of its own: it leads a process group that holds everything it starts (a vLLM server,
    its engine core and workers). It stops with this process: the kernel SIGTERMs it when this process dies (it then
    stops its own children), and `guard` SIGKILLs the group if any of it is left after the guard's grace. `stop()`
    ends it normally."""

    def __init__(self, cmd: list[str], *, env: dict, log, guard: OrphanGuard):
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_terminate_with_parent)
        self.guard, self.key = guard, f"group-{self.proc.pid}"
        guard.group(self.key, self.proc.pid)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the group, SIGKILL it if its leader is not gone within timeout_s, then SIGKILL what is left of it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # the leader's children share the group; make sure none outlives it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.guard.forget(self.key)


# ---- a process group of their own for the processes an engine starts -----------------------------------------------

_own_group = False  # set while own_process_group() is open: a child forked then leads a process group of its own


def _lead_own_group_after_fork() -> None:
    global _own_group
    if _own_group:
        _own_group = False  # the child's own children stay in its group
        os.setpgid(0, 0)


os.register_at_fork(after_in_child=_lead_own_group_after_fork)
_group_wrapper: str | None = None


def _group_leader_executable(python: str) -> str:
    """A launcher for multiprocessing's spawn method: it makes the new process a process group leader, then execs
    `python` with the arguments spawn gave it (same pid). Written once per process into a private temporary folder."""
    global _group_wrapper
    if _group_wrapper is None:
        import atexit
        import shlex
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="verl-kit-spawn-")
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "own-group")
        with open(path, "w") as f:
            exe = shlex.quote(python)
            lead = "import os, sys; os.setpgid(0, 0); os.execv(sys.argv[1], sys.argv[1:])"
            f.write(f"#!/bin/sh\nexec {exe} -I -S -c '{lead}' {exe} \"$@\"\n")
        os.chmod(path, 0o700)
        _group_wrapper = path
    return _group_wrapper


@contextlib.contextmanager
def own_process_group():
    """The processes multiprocessing starts in this block (forked, or spawned as vLLM does once CUDA is initialized)
    lead process groups of their own, and what they start joins them. A signal to this process's group (a job
    scheduler's or a container's SIGTERM to `-PGID`, a terminal's Ctrl-C) then reaches this process, not a colocated
    engine: the trainer's handler saves at the end of the step and stops the engine itself (the engine died first,
    and the step with it, before). The orphan guard still stops them if this process dies. Meant for the short start of
    an engine: a fork by another thread meanwhile gets a group of its own too."""
    import multiprocessing.spawn

    global _own_group
    python = multiprocessing.spawn.get_executable()
    multiprocessing.spawn.set_executable(_group_leader_executable(os.fsdecode(python)))
    _own_group = True
    try:
        yield
    finally:
        _own_group = False
        multiprocessing.spawn.set_executable(python)


# ---- the orphan guard: the guard process -------------------------------------------------------------------------

class Guard:
    """The guard process's state. Lines on stdin, `KIND KEY ARGS`:
        watch KEY PID...    processes that appear under the owner from now on, other than PID..., are KEY's (polled)
        settle KEY PID...   PID... are KEY's; stop polling for KEY
        group KEY PGID      process group PGID (a process started in a session of its own) is KEY's
        forget KEY          KEY was stopped normally: nothing of it to stop any more
    When the owner is gone (its pidfd readable): `stop_all`."""

    def __init__(self, owner: int, grace_s: float, files: tuple[str, str] | None):
        self.owner, self.grace_s, self.files = owner, grace_s, files
        self.me = os.getpid()
        self.procs: dict[str, dict] = {}  # key -> {pid: Process}
        self.groups: dict[str, tuple] = {}  # key -> (pgid, leader Process or None)
        self.watching: dict[str, set[int]] = {}  # key -> pids not its own
        self.buf = b""
        try:
            self.owner_started = psutil.Process(owner).create_time()
        except psutil.Error:
            self.owner_started = None

    def say(self, text: str) -> None:
        try:
            print(f"[verl_kit guard {self.me}] {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the owner's stderr may be gone with it
            pass

    def record(self, key: str, pids) -> None:
        mine = self.procs.setdefault(key, {})
        for pid in pids:
            if pid != self.me and pid not in mine:
                try:
                    mine[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass

    def poll(self) -> None:
        try:
            now = {p.pid for p in psutil.Process(self.owner).children(recursive=True)}
        except psutil.Error:
            return
        for key, before in self.watching.items():
            self.record(key, now - before)

    def handle(self, line: str) -> None:
        kind, key, *args = line.split()
        pids = [int(a) for a in args]
        if kind == "watch":
            self.watching[key] = set(pids) | {self.me}
            self.poll()
        elif kind == "settle":  # the watch's processes, as the owner saw them when it ended
            self.watching.pop(key, None)
            mine = self.procs.setdefault(key, {})
            for pid in set(mine) - set(pids):  # polled after the watch ended but before this line was read
                del mine[pid]
            self.record(key, pids)
        elif kind == "group":
            try:
                leader = psutil.Process(pids[0])
            except psutil.Error:
                leader = None
            self.groups[key] = (pids[0], leader)
        elif kind == "forget":
            for d in (self.procs, self.groups, self.watching):
                d.pop(key, None)

    def read_lines(self, data: bytes) -> None:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if line.strip():
                try:
                    self.handle(line.decode())
                except Exception as e:
                    self.say(f"ignored {line!r}: {e!r}")

    def run(self) -> None:
        """Read lines until the owner is gone, then stop what it started."""
        try:
            death = os.pidfd_open(self.owner)
        except (AttributeError, OSError):
            death = None
        fds = [0]
        while os.getppid() == self.owner:
            try:
                ready = select.select(fds + ([death] if death is not None else []), [], [],
                                      0.5 if self.watching or death is None else None)[0]
                if death is not None and death in ready:
                    break
                if 0 in ready:
                    data = os.read(0, 65536)
                    if not data:
                        fds = []  # the owner closed its end (it exits): wait for it to be gone
                    self.read_lines(data)
                if self.watching:
                    self.poll()
            except Exception as e:  # a bad line, a /proc hiccup: never leave the owner unguarded (nor stop anything)
                self.say(f"ignored: {e!r}")
                time.sleep(0.5)
        self.stop_all()

    def stop_all(self) -> None:
        """SIGKILL what is still recorded, but what ignores SIGTERM and the process groups get the grace first;
        remove the owner's files."""
        os.set_blocking(0, False)  # what the owner wrote before it died (a `forget`, a `settle`) counts
        try:
            while data := os.read(0, 65536):
                self.read_lines(data)
        except (BlockingIOError, OSError):
            pass
        targets = [p for d in self.procs.values() for p in d.values() if alive(p)]
        pgids = sorted({g for g, leader in self.groups.values() if self._ours(g, leader) and group_members(g)})
        now = [p for p in targets if not ignores_sigterm(p)]
        rest = [p.pid for p in targets if p not in now]
        if targets or pgids:
            self.say(f"trainer {self.owner} is gone, stopping what it started: SIGKILL to processes "
                     f"{[p.pid for p in now]}; {self.grace_s:g}s to exit for processes {rest} and process groups "
                     f"{pgids}")
        # An engine's processes have no client any more: SIGKILL (vLLM's own SIGTERM shutdown takes 5 to 15 s on
        # CPU). Those that ignore SIGTERM (multiprocessing's resource tracker: it unlinks the shared memory the killed
        # ones leaked, once they are gone) and a server's group (SIGTERMed by the kernel with the owner: the server
        # stops its engine itself) get the grace, then SIGKILL.
        send(now, [], signal.SIGKILL)
        targets, pgids = wait_gone(targets, pgids, self.grace_s)
        send(targets, pgids, signal.SIGKILL)
        wait_gone(targets, pgids, 5.0)
        self.remove_files()

    @staticmethod
    def _ours(pgid: int, leader) -> bool:
        """The group's leader as recorded, or no process with its pid (a pid stays taken while its group has
        members)."""
        if psutil.pid_exists(pgid):
            return leader is not None and leader.is_running()
        return True

    def remove_files(self) -> None:
        """The owner's files (its weight-sync slots): nothing maps them any more; removed now rather than at the next
        run's sweep."""
        if self.files is None:
            return
        try:
            if psutil.Process(self.owner).create_time() != self.owner_started:
                return  # its pid is another process's now, which may have files of its own
        except psutil.Error:
            pass
        folder, pattern = self.files
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            m = re.fullmatch(pattern, name)
            if m and m.group(1) == str(self.owner):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


# ---- the reaper around one node's `accelerate launch` (verl_kit.launch.cluster.NodeAgent) ------------------------

REAPER_TAG = "\x00verl-kit-reaper"  # prefix of the reaper's own lines to its agent: its pid, then the exit code


def reaper_command(parent_pid: int, cmd: list[str], grace_s: float) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "reap", "--parent", str(parent_pid), "--grace_s", str(grace_s),
            "--", *cmd]


def _say_to_agent(text: str) -> None:
    try:
        print(f"{REAPER_TAG} {text}", flush=True)
    except (BrokenPipeError, OSError):  # the agent is gone; nobody reads our output any more
        pass


def reap(parent_pid: int, cmd: list[str], grace_s: float) -> int:
    """Run `cmd`, report its exit code, and take every descendant down with it.

    The reaper detaches from its agent (double fork): Ray SIGKILLs a dead worker's direct children, which would kill
    the reaper before it could clean up, while the launcher and its ranks live on. As a child subreaper (Linux prctl
    36) it also inherits the training ranks that torchrun starts in their own sessions, even if torchrun dies. It
    ends the tree when the launch ends, on SIGTERM (the agent's stop) and when the agent process disappears."""
    parent = psutil.Process(parent_pid)
    if os.fork() > 0:  # the agent's direct child exits at once; the grandchild carries on
        os._exit(0)
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a handler, not SIG_IGN: children must not inherit it
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _say_to_agent(f"pid {os.getpid()}")
    child = subprocess.Popen(cmd)
    while child.poll() is None and not stop.is_set() and parent.is_running():
        stop.wait(0.5)
    if child.poll() is None:
        why = "stop requested" if stop.is_set() else f"its agent (pid {parent_pid}) is gone"
        try:
            print(f"[reaper] {why}: terminating the launch and its workers", flush=True)
        except (BrokenPipeError, OSError):
            pass
        child.terminate()  # through Popen, not psutil: psutil would reap it and lose its exit code
        kill_tree([p for p in descendants() if p.pid != child.pid], grace_s)
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
    rc = child.wait()
    kill_tree(descendants(), grace_s)  # ranks orphaned by a crashed launcher
    rc = rc if rc >= 0 else 128 - rc
    _say_to_agent(f"exit {rc}")
    return rc


def main(argv: list[str]) -> int:
    recipe: list[str] = []
    if "--" in argv:  # the reaper's command, untouched
        k = argv.index("--")
        argv, recipe = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(prog="verl_kit/launch/processes.py",
                                description="the orphan guard and the reaper (see the module docstring)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("guard", help="the orphan guard of process OWNER (started by OrphanGuard)")
    s.add_argument("owner", type=int)
    s.add_argument("grace_s", type=float)
    s.add_argument("files", nargs="*", help="FOLDER PATTERN: the owner's files, removed when it dies")
    s = sub.add_parser("reap", help="run the command after -- and take its process tree down with it")
    s.add_argument("--parent", type=int, required=True, help="the agent: its death ends the launch")
    s.add_argument("--grace_s", type=float, default=10)
    args = p.parse_args(argv)
    if args.command == "guard":
        if len(args.files) not in (0, 2):
            p.error("guard: FOLDER and PATTERN go together")
        Guard(args.owner, args.grace_s, tuple(args.files) or None).run()
        return 0
    return reap(args.parent, recipe, args.grace_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
