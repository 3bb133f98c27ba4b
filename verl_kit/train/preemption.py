"""Preemption: SIGTERM (Slurm, Kubernetes, `timeout`, `ray job stop`, `kill`) and SIGUSR1 (Slurm's early warning,
`sbatch --signal=USR1@120`) ask a run to stop. The handler only notes the signal (the run's StopSignal, held by its
train.Checkpoints): at the next step boundary (Checkpoints.save_if_due, one collective per step) every rank learns
that one of them got it, they save a complete checkpoint together and exit with 128 + the signal's number, as a shell
reports a process ended by that signal. The
first signal puts the default action back, so a second one ends the process at once, mid-step or mid-save (a
checkpoint being written is a temporary until it is complete). Megatron's `--exit-signal-handler` and Lightning's
SIGTERM handling work the same way."""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """The stop request of this process: `received` is the first signal's number, or 0."""

    def __init__(self):
        self.received = 0
        self.announce = True

    def arm(self, announce: bool = True) -> None:
        """Catch SIGTERM and SIGUSR1 from now on (`announce`: log a line when one arrives; the main process). Python
        runs signal handlers in the main thread only, so elsewhere (a test's worker thread) this does nothing."""
        self.received, self.announce = 0, announce
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def disarm(self) -> None:
        """Back to the default action of both signals."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, signal.SIG_DFL)

    def _handle(self, signum, _frame) -> None:
        self.received = self.received or signum
        self.disarm()  # the next SIGTERM/SIGUSR1 takes the default action: the process ends at once
        if self.announce:
            logger.warning("%s received: saving a checkpoint at the end of this step, then exiting (send it again to "
                           "exit at once, without saving)", signal.Signals(signum).name)

