"""Calls cut at a deadline, leaving nothing behind: reward functions (--reward_timeout_s) and tools (--tool_timeout_s).

Python cannot stop a thread, so a call waited for on a thread and abandoned at its timeout runs on, holding what it
holds; each timeout can leave one more. Here a call made on the main thread (the recipes' training loop: rewards, and
episodes with synchronous rollouts) runs on that thread and is *interrupted* at its deadline: a watchdog thread sends
the main thread a signal of its own (DEADLINE_SIGNAL, a real-time signal no library of the kit uses), whose handler
raises CallInterrupted where the call is. A blocking system call (sleep, a socket, a lock, a subprocess wait) returns
with EINTR and the exception is raised there; a Python loop is stopped at its next bytecode. The signal is sent again
every REPEAT_S until the call returns, so a call that catches the exception (`except BaseException`) is interrupted
again. Nothing is abandoned, and math_answer keeps the SIGALRM limits of math-verify, which work on the main thread
only. Only C code that holds the GIL without returning cannot be interrupted this way.

A call made on another thread (episodes under --async_rollout run on the rollout thread) cannot be interrupted: it runs
on a daemon thread, waited `timeout_s`, and one that does not return is abandoned there. At most MAX_ABANDONED of
those may be running at once, per process: the next call then stops the run with one line naming what hangs, rather
than piling threads up (each would hold its memory, and CPU if it spins)."""

from __future__ import annotations

import signal
import threading
import time

from verl_kit.errors import UserError

DEADLINE_SIGNAL = signal.SIGRTMIN + 5
REPEAT_S = 1.0
# Calls on threads other than the main one that are still running past their timeout. A call abandoned every
# timeout (the calls of a turn run one after another) that returns within 8 timeouts never reaches it: only calls
# that hang for good do.
MAX_ABANDONED = 8


class DeadlineExceeded(Exception):
    """The call did not return within its timeout (it was interrupted, or abandoned on its thread)."""


class CallInterrupted(BaseException):
    """Raised inside a call at its deadline: a BaseException, so that the call's own `except Exception` lets it
    through (as KeyboardInterrupt)."""


_armed = False  # a deadline call is running on the main thread: the signal handler raises
_installed = False
_abandoned: list[tuple[threading.Thread, str]] = []
_lock = threading.Lock()


def _handler(signum, frame):
    if _armed:
        raise CallInterrupted


def call_with_deadline(fn, timeout_s: float | None, what: str):
    """fn() cut after `timeout_s` seconds (None: no limit, here and now): its result, or DeadlineExceeded. `what`
    names the call in the one-line error of the cap on abandoned calls ("tool calculate", "reward function judge").
    On the main thread fn runs there and is interrupted at the deadline; on another thread it runs on a daemon thread
    that is abandoned at the deadline, at most MAX_ABANDONED at a time (see the module docstring)."""
    if timeout_s is None:
        return fn()
    if threading.current_thread() is threading.main_thread() and not _armed:
        return _on_main_thread(fn, timeout_s)
    return _on_a_thread(fn, timeout_s, what)


def _on_main_thread(fn, timeout_s: float):
    global _armed, _installed
    if not _installed:  # once per process, on first use (importing the module changes nothing)
        signal.signal(DEADLINE_SIGNAL, _handler)
        _installed = True
    done, main = threading.Event(), threading.main_thread().ident

    def watchdog():
        wait = timeout_s
        while not done.wait(wait):
            signal.pthread_kill(main, DEADLINE_SIGNAL)
            wait = REPEAT_S

    dog = threading.Thread(target=watchdog, name="verl_kit-deadline", daemon=True)
    dog.start()
    try:
        try:
            _armed = True  # a signal before this does nothing (the watchdog repeats it)
            return fn()
        finally:
            _armed = False  # first: a signal from now on does nothing
    except CallInterrupted:
        raise DeadlineExceeded from None
    finally:
        _armed = False
        done.set()
        dog.join()


def _on_a_thread(fn, timeout_s: float, what: str):
    with _lock:
        _abandoned[:] = [(t, w) for t, w in _abandoned if t.is_alive()]
        if len(_abandoned) >= MAX_ABANDONED:
            names = sorted({w for _, w in _abandoned})
            raise UserError(f"{len(_abandoned)} calls cut at their timeout are still running ({', '.join(names)}): a "
                            "call off the main thread cannot be stopped, so the run stops rather than pile up threads; "
                            "fix what hangs, or give it its own timeout")
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            box["error"] = e

    t = threading.Thread(target=target, name=f"verl_kit-call {what}", daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        with _lock:
            _abandoned.append((t, what))
        raise DeadlineExceeded(f"{what} did not return within {time.monotonic() - t0:.3g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def abandoned() -> int:
    """Calls cut at their timeout off the main thread that are still running, in this process."""
    with _lock:
        return sum(t.is_alive() for t, _ in _abandoned)
