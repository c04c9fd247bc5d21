"""Status lines for people ("[stratkit] resumed from ...") go through `logging`.

Every line stratkit writes for a person is a record on a `stratkit.*` logger, so
a user can filter, redirect or silence it like any library's output. Two
audiences, one rule:

- a user who never configured logging keeps today's console: the `stratkit`
  logger has one handler that writes `[stratkit] message` to the *current*
  `sys.stdout` (warnings and errors, as `[stratkit] warning: message`, to
  `sys.stderr`), looked up per record so redirected or captured streams work;
- a user whose root logger already writes to the console (`logging.basicConfig()`,
  absl, a notebook's handler) gets the records from that handler, once: ours
  then stays quiet instead of printing every line twice.

absl's logging calls a bare `logging.basicConfig()` by itself the first time
anything logs through it with no root handler (TensorFlow's ClusterCoordinator
watchdog does, on every parameter-server chief). That default handler (stderr,
`logging.BASIC_FORMAT`) is not taken as the user's console: the lines stay
`[stratkit] ...` on stdout and do not reach it a second time.

`logging.getLogger("stratkit").setLevel(logging.WARNING)` silences the status
lines and keeps the warnings. Imports no TensorFlow.

It also holds the one status a stratkit process ends with on purpose:
`EXIT_PREEMPTED` (75), and which signals mean "preempted" (`preemption_signals`),
read alike by the training processes and by `stratkit launch`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
from typing import Iterator, Mapping

from stratkit.errors import ConfigError

_ROOT = "stratkit"

#: The exit status of a process that stopped on a preemption notice after writing its backup (EX_TEMPFAIL of
#: sysexits.h: "try again later"). The one place it is defined: `stratkit.training.checkpoint` exits with it,
#: `stratkit launch` restarts on it without counting a failure (and exits with it when it was preempted
#: itself), `stratkit.process.report` words it.
EXIT_PREEMPTED = 75
#: Names an extra signal that means "preempted" (e.g. USR2), as a name or a number; SIGTERM always does.
#: `stratkit launch --preemption-signal` sets it for its tasks.
PREEMPTION_SIGNAL_VAR = "STRATKIT_PREEMPTION_SIGNAL"
#: Inside a Slurm job (this variable set) the extra signal is SIGUSR1 unless PREEMPTION_SIGNAL_VAR names
#: another: what `--signal=USR1@N` sends every task N s before the time limit, and what
#: examples/slurm_requeue.sh hands them from `--signal=B:USR1@N`. Left alone, USR1 would end the task
#: (its default action) with no backup, so there is nothing to keep by not catching it.
SLURM_JOB_VAR = "SLURM_JOB_ID"


class _Console(logging.Handler):
    """Today's console output, unless a console handler of the user's already shows the record."""

    def emit(self, record: logging.LogRecord) -> None:
        user, implicit = _root_consoles()
        # Checked by logging after this logger's handlers: keep the record from a bare default handler.
        logging.getLogger(_ROOT).propagate = user or not implicit
        if user:
            return
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            message = record.getMessage()
            if record.levelno >= logging.WARNING and not message.startswith(("warning:", "error:")):
                message = f"{record.levelname.lower()}: {message}"
            stream.write(f"[stratkit] {message}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or vanished stream must never fail training
            pass


def _root_consoles() -> tuple[bool, bool]:
    """(a console handler the user configured, a bare `basicConfig()` default) on the root logger."""
    user = implicit = False
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if _bare_default(handler):
                implicit = True
            else:
                user = True
    return user, implicit


def _bare_default(handler: logging.Handler) -> bool:
    """The handler `logging.basicConfig()` makes with no arguments, as absl calls it by itself."""
    formatter = handler.formatter
    return (type(handler) is logging.StreamHandler and type(formatter) is logging.Formatter
            and formatter._fmt == logging.BASIC_FORMAT)  # noqa: SLF001 - the stdlib's own format string


#: Set in `hushed()`: this context's stratkit status lines and warnings are another worker's to say.
_HUSHED: contextvars.ContextVar[bool] = contextvars.ContextVar("stratkit_hushed", default=False)


class _Hush(logging.Filter):
    """Drops a record below ERROR logged inside `hushed()` (a filter on each stratkit logger, so a handler of the
    user's does not get it either)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not _HUSHED.get()


_HUSH = _Hush()


@contextlib.contextmanager
def hushed(quiet: bool = True) -> Iterator[None]:
    """Within the block (this thread or task), stratkit's status lines and warnings are not said when `quiet`:
    what every worker of a run works out alike (a table's plan) is said once, by the chief; errors always are."""
    token = _HUSHED.set(bool(quiet) or _HUSHED.get())
    try:
        yield
    finally:
        _HUSHED.reset(token)


def logger(name: str) -> logging.Logger:
    """The logger for a stratkit module (`status.logger(__name__)`), with the console handler installed."""
    root = logging.getLogger(_ROOT)
    if not any(isinstance(h, _Console) for h in root.handlers):
        root.addHandler(_Console())
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
    out = logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
    if _HUSH not in out.filters:
        out.addFilter(_HUSH)
    return out


def parse_signal(text: str, name: str = PREEMPTION_SIGNAL_VAR) -> int:
    """`USR1`, `SIGUSR1` or `10` as a signal number a process can catch.

    Raises:
        ConfigError: naming `name`, the value and what it takes.
    """
    value = text.strip().upper()
    number = int(value) if value.isdigit() else getattr(signal, value if value.startswith("SIG") else f"SIG{value}",
                                                          None)
    if not isinstance(number, int) or number not in {int(s) for s in signal.valid_signals()} \
            or number in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"{name}={text!r} is not a signal a process can catch. Fix: a name such as USR1 or SIGUSR2 "
                          "(Slurm's --signal=USR1@120 goes with USR1, the default inside a Slurm job), or unset it "
                          "(SIGTERM is always a preemption notice)")
    return int(number)


def preemption_signals(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The signals that mean "preempted": SIGTERM, and the one STRATKIT_PREEMPTION_SIGNAL names (inside a
    Slurm job, SIGUSR1 when it names none)."""
    environ = os.environ if environ is None else environ
    text = environ.get(PREEMPTION_SIGNAL_VAR, "").strip()
    extra = parse_signal(text) if text else (int(signal.SIGUSR1) if environ.get(SLURM_JOB_VAR) else None)
    return (int(signal.SIGTERM),) if extra in (None, signal.SIGTERM) else (int(signal.SIGTERM), extra)
