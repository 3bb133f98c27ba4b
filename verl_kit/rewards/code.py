"""Code rewards: a model's program runs in a sandbox, never with the trainer's rights.

    --reward_funcs verl_kit.rewards:code_tests      # HumanEval's columns: `test` (defines check) and `entry_point`

`code_tests` scores each completion 1.0 when its program (the prompt, the completion, then the row's test code, then
`check(entry_point)`) exits 0 in `run_sandboxed`, else 0.0. A prompt given as chat messages takes the completion's
code alone (its ```python block, or its whole text).

`run_sandboxed` runs a Python program (given on stdin) in a child process that leads a session of its own, with a
minimal environment (no variable of the trainer's: no keys, no tokens) and rlimits on CPU time, address space, file
size, open files and processes, and kills it at a wall-clock deadline. Where the trainer runs as root (as in this
repository's CI) it also gets, before its first instruction:
  - a network namespace of its own, loopback down: no socket reaches anything;
  - a mount namespace with fresh, size-capped tmpfs over /tmp, /var/tmp and /dev/shm: it starts in an empty /tmp and
    what it writes anywhere it may write vanishes with it (the trainer's files in those folders are out of its sight);
    a folder others may not enter that holds the interpreter (root's home) is replaced by an empty one holding only
    the interpreter's folders (keys, tokens and caches there are out of sight);
  - a uid of its own, drawn at random from a range no account uses, no groups: it cannot read another user's files
    (the trainer's /proc/<pid>/environ included), signal the trainer, or exceed its process limit (RLIMIT_NPROC binds
    an unprivileged uid), and at the end every process of that uid is killed, daemons that left the session too.
Not root: the rlimits, the session and the minimal environment only (said in one warning line, once). A hostile
program (fork bomb, infinite loop, huge allocation, huge file, writes outside its folder, a socket, reading the
parent's environment, killing its parent, a child left running) costs a zero reward: tests/rewards/test_code.py.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one program may use: wall-clock and CPU seconds, address space, the size of any file it writes, open
    files, processes (threads count), and the size of each private tmpfs."""
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mib: int = 1024
    file_mib: int = 16
    open_files: int = 64
    processes: int = 32
    tmpfs_mib: int = 64


UID_BASE, UID_SPAN = 3_000_000_000, 1 << 28  # sandbox uids: far above any account's, one drawn per program

# Runs as the sandbox's first process (root: namespaces and the uid first), then becomes the program's interpreter.
_LAUNCHER = r"""
import ctypes, os, resource, sys
uid, cpu, mem, fsize, nofile, nproc, tmpfs = map(int, sys.argv[1:8])
python, needed = sys.argv[8], sys.argv[9:]
if uid:
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, kind, flags, data=None):
        if libc.mount(source.encode(), target.encode(), kind and kind.encode(), flags, data and data.encode()) != 0:
            raise SystemExit(f"sandbox: mount {target} failed: " + os.strerror(ctypes.get_errno()))

    if libc.unshare(0x00020000 | 0x40000000) != 0:  # CLONE_NEWNS | CLONE_NEWNET
        raise SystemExit("sandbox: unshare failed: " + os.strerror(ctypes.get_errno()))
    mount("none", "/", None, 0x4000 | 0x40000)  # MS_REC | MS_PRIVATE: nothing leaks out of this namespace
    # Fresh tmpfs over /tmp, /var/tmp, /dev/shm, and over a folder other users may not enter (root's home, 0700) that
    # holds the interpreter; the interpreter's folders under any of them (a checkout in /tmp) bound back in, through
    # handles taken before: the rest (keys, tokens, caches, other users' files) out of sight.
    covered = ["/tmp", "/var/tmp", "/dev/shm"]
    for path in needed:
        parts = path.split("/")
        for k in range(2, len(parts)):
            top = "/".join(parts[:k])
            if not os.stat(top).st_mode & 0o001:
                covered.append(top)
                break
    keep = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in needed
            if any(path == top or path.startswith(top + "/") for top in covered)}
    for top in dict.fromkeys(covered):
        if os.path.isdir(top):
            writable = top in ("/tmp", "/var/tmp", "/dev/shm")
            mount("tmpfs", top, "tmpfs", 0x2 | 0x4 | (0x8 if top != "/tmp" and writable else 0),  # nosuid nodev
                  f"size={tmpfs}m,mode=1777" if writable else "size=1m,mode=755")
    for path, fd in keep.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, 0x1000 | 0x4000)  # MS_BIND | MS_REC
        os.close(fd)
os.chdir("/tmp")
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if uid:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execve(python, [python, "-I", "-"], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
                                         "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
"""

_said = False


def isolation() -> str:
    """What this machine's sandbox gives, in words."""
    if os.geteuid() == 0 and sys.platform == "linux":
        return ("network and mount namespaces (no network; private /tmp, /var/tmp, /dev/shm), a uid of its own, "
                "rlimits, a session, a minimal environment")
    return ("rlimits, a session and a minimal environment only (not root: no namespaces, the trainer's own uid; run "
            "the trainer as root in a container for the full sandbox)")


@dataclass
class Outcome:
    passed: bool
    reason: str  # "" when it passed; else why not: its exit code, a signal, the deadline, the tail of its stderr


@functools.cache
def _interpreter_folders() -> tuple[str, ...]:
    """What the program's interpreter reads: its installation, the virtual environment, the kit's checkout."""
    import verl_kit

    found = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable),
                                           os.path.dirname(os.path.realpath(sys.executable)),
                                           os.path.dirname(os.path.dirname(verl_kit.__file__)))}
    return tuple(sorted(p for p in found if not any(p != q and p.startswith(q + "/") for q in found)))


def run_sandboxed(program: str, limits: Limits = Limits()) -> Outcome:
    """Run `program` (Python source) in the sandbox; passed when it exits 0 within the limits."""
    root = os.geteuid() == 0 and sys.platform == "linux"
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if root else 0
    argv = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(uid), str(limits.cpu_s), str(limits.memory_mib << 20),
            str(limits.file_mib << 20), str(limits.open_files), str(limits.processes), str(limits.tmpfs_mib),
            sys.executable, *_interpreter_folders()]
    with tempfile.TemporaryFile() as err:  # the program's stderr, for the reason (bounded by its file-size limit)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True, env={"PATH": "/usr/bin:/bin"})
        try:
            proc.stdin.write(program.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            rc = proc.wait(limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        _kill_all(proc, uid)
        if rc is None:
            rc = proc.wait()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 2000))
        tail = err.read().decode(errors="replace").strip().splitlines()
    if timed_out:
        return Outcome(False, f"over the {limits.wall_s:g} s deadline")
    if rc == 0:
        return Outcome(True, "")
    why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return Outcome(False, f"{why}: {tail[-1][:300]}" if tail else why)


def _kill_all(proc: subprocess.Popen, uid: int) -> None:
    """Kill the program's session and, under root, every process of its uid (what left the session too): a helper
    takes that uid and sends SIGKILL to every process it may signal."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid:
        code = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); os.kill(-1, 9)"
        subprocess.run([sys.executable, "-I", "-S", "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=30)


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def _text(x) -> str:
    if isinstance(x, list):  # chat messages: the last one's content
        return str(x[-1].get("content") or "") if x else ""
    return str(x or "")


def program_of(prompt, completion, test: str, entry_point: str) -> str:
    """The program a completion is scored by: a text prompt (HumanEval's: the signature and docstring) followed by
    the completion; for a chat prompt, the completion's code (its first ```python block, else its text) after the
    import lines of the code the prompt showed (a model that rewrites the function often drops them); then the row's
    test code and `check(entry_point)`."""
    text = _text(completion)
    if isinstance(prompt, list):
        blocks = _FENCE.findall(text)
        shown = "\n".join(b for m in prompt for b in _FENCE.findall(str(m.get("content") or "")))
        imports = [line for line in shown.splitlines() if line.startswith(("import ", "from "))]
        code = "\n".join([*imports, blocks[0] if blocks else text])
    else:
        code = str(prompt) + text
    return f"{code}\n\n{test}\n\ncheck({entry_point})\n"


def code_tests(prompts, completions, test, entry_point, limits: Limits | None = None, workers: int | None = None,
               **columns) -> list[float]:
    """1.0 per completion whose program passes the row's tests in the sandbox (run_sandboxed), else 0.0; a reward
    function in TRL's convention (`test` and `entry_point` are the dataset's columns, HumanEval's names)."""
    global _said
    limits = limits or Limits()
    if not _said:
        _said = True
        log = logger.info if os.geteuid() == 0 else logger.warning
        log("code_tests sandbox: %s; limits %s", isolation(), limits)
    programs = [program_of(p, c, t, e) for p, c, t, e in zip(prompts, completions, test, entry_point)]
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(lambda source: run_sandboxed(source, limits), programs))
    return [1.0 if o.passed else 0.0 for o in outcomes]



