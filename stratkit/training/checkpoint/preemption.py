"""Preemption notices: the signal, the step every worker stops at, and the exit that says "preempted".

A platform that takes a machine away warns first: SIGTERM (Kubernetes,
spot VMs, `stratkit launch` forwarding its own), or a signal the job asked
for (Slurm's `--signal=USR1@120`: USR1 is one inside a Slurm job; else name it with
STRATKIT_PREEMPTION_SIGNAL=USR1 or `stratkit launch --preemption-signal USR1`). While a backup is configured,
`Notice` catches those signals (in the main thread; the handler only records
the time and wakes its `listener`), and `stratkit.training.checkpoint.agreement`
makes every worker stop at one step boundary (on several workers the notice
travels through TensorFlow's coordination service while they train, so it is
acted on within a step whatever the step time): every worker writes its
backup there and exits with `stratkit.status.EXIT_PREEMPTED` (75). Further signals during the save
are counted and ignored: the save finishes (or a SIGKILL leaves the previous
backup standing: every file is renamed into place only when complete). The
handlers stay until the process is gone, so a launcher's SIGTERM to a task
that is already leaving does not turn its 75 into a death by signal.

TensorFlow's own notifier: in a MultiWorkerMirrored worker, TensorFlow's
coordination agent installs a C++ SIGTERM handler when the strategy starts
(tsl's `PreemptionNotifier`, "SIGTERM caught at ..."), which records the notice
for its PreemptionCheckpointHandler and otherwise lets training go on (measured
with `sigaction` on 2 workers, TF 2.21: SIGTERM's handler is SIG_DFL before
`make_strategy()` and TensorFlow's after it, while Python's `signal.getsignal`
still says SIG_DFL). Python's `signal.signal` replaces the process's handler, so
`Notice.install` runs after the strategy exists (at `on_train_begin`) and
stratkit's handler is the one that acts (the 2-worker tests see it act).
`uninstall` puts back what Python knows of, SIG_DFL: after such a `fit`, SIGTERM
ends the worker instead of being swallowed.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from stratkit import status
from stratkit.status import parse_signal, preemption_signals  # noqa: F401 - this module's API too

log = status.logger(__name__)

#: Names an extra signal that means "preempted" (`stratkit.status`, where the launcher reads it too).
SIGNAL_VAR = status.PREEMPTION_SIGNAL_VAR
#: After a preempted process raised `Preempted`, the longest its interpreter may take to exit before it is ended
#: (measured: a MultiWorkerMirrored worker's interpreter does not finish exiting by itself within 2 s, its
#: runtime waiting on its peers at shutdown).
EXIT_DEADLINE = 1.0


#: Runs a function in this process's main thread and returns when it ran, for a `fit` in another thread (Ray
#: Train runs `train_loop_per_worker` in a thread of its worker actor, whose main thread runs the actor's calls:
#: `stratkit.ray.train.RayReportCallback` sets it). None: such a fit catches no notice, and says so.
_main_thread_caller: Callable[[Callable[[], None]], None] | None = None


def set_main_thread_caller(caller: Callable[[Callable[[], None]], None] | None) -> Any:
    """Set how `Notice` installs its handlers when `fit` runs outside the main thread; returns the previous."""
    global _main_thread_caller
    previous, _main_thread_caller = _main_thread_caller, caller
    return previous


class Preempted(SystemExit):
    """Raised out of `fit` after the preemption backup was written: the process exits with status 75."""

    def __init__(self, message: str) -> None:
        super().__init__(status.EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Notice:
    """This process's preemption notice: the handlers while training runs, and when the first signal came."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = signals
        self.signum: int | None = None
        self.wall: float = 0.0       # time.time() of the first notice (for the log)
        self.at: float = 0.0         # time.monotonic() of the first notice
        self.repeats = 0
        #: Called (in the handler) at the first notice; it must be safe there (`queue.SimpleQueue.put`).
        self.listener: Callable[[], None] | None = None
        self._previous: dict[int, Any] = {}

    @property
    def noticed(self) -> bool:
        return self.signum is not None

    def install(self) -> bool:
        """Catch the signals (Python runs handlers in the main thread, and only it may set them: from another
        thread through the main-thread caller, see `set_main_thread_caller`); False where it cannot."""
        if threading.current_thread() is not threading.main_thread():
            if _main_thread_caller is None:
                log.warning("fit runs outside the main thread: preemption notices (%s) are not caught here, so a "
                            "preempted run resumes from its last backup", ", ".join(map(_name, self.signals)))
                return False
            _main_thread_caller(self._install_here)
            return True
        self._install_here()
        return True

    def _install_here(self) -> None:
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        if not self._previous:
            return
        if threading.current_thread() is not threading.main_thread() and _main_thread_caller is not None:
            _main_thread_caller(self._uninstall_here)
        else:
            self._uninstall_here()

    def _uninstall_here(self) -> None:
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.wall, self.at = signum, time.time(), time.monotonic()
            listener = self.listener
            if listener is not None:
                listener()
            self.repeats += 1  # e.g. a second SIGTERM during the save: the save goes on

    def describe(self) -> str:
        if self.signum is None:
            return "a preemption notice reached another worker"
        stamp = time.strftime("%H:%M:%S", time.localtime(self.wall)) + f".{int(self.wall % 1 * 1000):03d}"
        return f"preemption notice: {_name(self.signum)} at {stamp}"


def _name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_soon(code: int = status.EXIT_PREEMPTED, deadline: float = EXIT_DEADLINE) -> None:
    """Make sure the process ends with `code` promptly once `Preempted` has unwound the script.

    `Preempted` unwinds `fit` and the script (their `finally` blocks run), then
    two things bound the rest: an exit handler, registered last so it runs
    first, ends the process with `code` as soon as the interpreter starts
    exiting (measured: a MultiWorkerMirrored worker's interpreter otherwise
    waits seconds in TensorFlow's teardown for its peers, after Python has put
    SIGTERM back to its default, so a launcher's SIGTERM then turned its 75 into
    a death by signal); and a daemon thread ends it after `deadline` s if the
    script is still running or waiting for its own threads.
    """
    atexit.register(_leave, code)

    def end() -> None:
        time.sleep(deadline)
        _leave(code)

    threading.Thread(target=end, name="stratkit-preempted-exit", daemon=True).start()


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)
