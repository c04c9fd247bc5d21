"""How a child ended, in words, and the root-cause report: one format for every front door.

`describe_returncode` turns a return code into words with a hint for the
usual cause; `TaskFailure` records the first observed failure of a group of
tasks; `format_failure_report` prints it (the task, how it ended, the
exception it died of, its last lines, what became of the others). The
launcher reports with title "stratkit launch", the Spark runner with its own.

Imports no TensorFlow.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from stratkit.process.tracebacks import last_exception
from stratkit.status import EXIT_PREEMPTED

_SIGNAL_HINTS = {
    "SIGKILL": "often out of memory (the kernel's OOM killer sends SIGKILL): check `dmesg` or the container's "
               "memory limit, or lower the batch size",
    "SIGSEGV": "a crash in native code (TensorFlow or an extension module)",
    "SIGABRT": "an abort in native code (e.g. a TensorFlow CHECK failure)",
    "SIGBUS": "a crash in native code, or /dev/shm is full",
    "SIGTERM": "stopped from outside (a scheduler's preemption, or `kill`)",
    "SIGINT": "interrupted (Ctrl-C)",
}


def signal_name(number: int) -> str:
    """"SIGKILL" for 9; "signal 99" for a number that names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


#: The cluster runners' rule (Spark, Ray): after one task exited 75, the longest the others get to exit by
#: themselves before the runner kills them. They stop at the same step (the per-step agreement) and each writes
#: its backup there, so they end within one backup write and 1 s; a kill before that would leave the resume at
#: an older backup.
PREEMPTED_GRACE = 60.0


def is_preempted(returncode: int | None) -> bool:
    """True for the status a stratkit training process exits with after a preemption backup (75)."""
    return returncode == EXIT_PREEMPTED


def describe_returncode(returncode: int) -> str:
    """A subprocess return code in words: "exited with code 3", "killed by SIGKILL (signal 9) -- often ...".

    Negative codes are signals (Popen's convention). 129..159 from a shell
    wrapper usually mean the program it ran died of signal code - 128.
    """
    if returncode < 0:
        name = signal_name(-returncode)
        hint = _SIGNAL_HINTS.get(name)
        return f"killed by {name} (signal {-returncode})" + (f" -- {hint}" if hint else "")
    text = f"exited with code {returncode}"
    if returncode == EXIT_PREEMPTED:
        return text + (" (preempted: it stopped on a preemption notice at a step boundary, after writing its "
                       "backup; a restart resumes there)")
    if 128 < returncode < 160:
        name = signal_name(returncode - 128)
        hint = _SIGNAL_HINTS.get(name)
        text += f" (128 + {returncode - 128}: a program it ran was killed by {name}" + (f" -- {hint})" if hint else ")")
    return text


@dataclass(frozen=True)
class TaskFailure:
    """The first observed failure of an attempt: which task, how it ended, what it printed last.

    Attributes:
        task: "worker:1" (the Spark runner uses its own names, e.g. "partition 3").
        returncode: the exit code (negative: the signal), or None when the task was still
            running at the timeout.
        last_lines: the task's last output lines, stdout and stderr interleaved.
        pid: the process id, when known.
        address: the task's "host:port" in the cluster, when it has one.
        attempt: 0 for the first attempt, 1 after the first restart, ...
        log_file: the task's full log, when one was written.
        timed_out_after: the timeout in seconds, when the attempt ran out of time.
        exception: the last exception the task printed -- its "module.Type: message" line and
            the lines after it -- found in its whole output, not only in `last_lines`.
        timeout_setting: how the reader sets the timeout ("--timeout" for the launcher,
            "timeout=" for a Python API), named in the timeout's wording.
        ended: how the task ended, in words, when the caller knows better than the return code
            (e.g. a Spark task that failed before its process started); replaces the wording.
    """

    task: str
    returncode: int | None
    last_lines: tuple[str, ...] = ()
    pid: int | None = None
    address: str | None = None
    attempt: int = 0
    log_file: str | None = None
    timed_out_after: float | None = None
    exception: tuple[str, ...] = ()
    timeout_setting: str = "--timeout"
    ended: str | None = None

    @property
    def reason(self) -> str:
        """How the task ended, in words."""
        if self.ended is not None:
            return self.ended
        if self.timed_out_after is not None:
            space = "" if self.timeout_setting.endswith("=") else " "
            return (f"still running after {self.timeout_setting}{space}{self.timed_out_after:g} s (hung? e.g. a "
                    "collective waiting for a peer that is gone)")
        return describe_returncode(self.returncode if self.returncode is not None else 0)


def format_failure_report(failure: TaskFailure, other_tasks: Sequence[str] = (), attempts: int | None = None,
                          title: str = "stratkit launch") -> str:
    """The root-cause report: the failed task, how it ended, its last lines, what happened to the rest.

    Args:
        failure: the first observed failure.
        other_tasks: one line per other task (e.g. "worker:0 (pid 12): stopped by the launcher").
        attempts: total attempts allowed, to print "attempt 2 of 3".
        title: who reports (the Spark runner passes its own).
    """
    rule = "=" * 78
    where = ", ".join(x for x in (f"pid {failure.pid}" if failure.pid else "", failure.address or "") if x)
    attempt = f"attempt {failure.attempt + 1}" + (f" of {attempts}" if attempts else "")
    lines = [rule, f"{title}: root cause (first observed failure)", rule,
             f"task:    {failure.task}" + (f" ({where})" if where else "") + f", {attempt}",
             f"failure: {failure.reason}"]
    if failure.log_file:
        lines.append(f"log:     {failure.log_file}")
    # Always shown, even when it is in the tail: a long message (TensorFlow's) pushes it out.
    exception = failure.exception or last_exception(failure.last_lines)
    if exception:
        lines.append(f"exception: {exception[0]}")
        lines.extend(f"  | {line}" for line in exception[1:])
    if failure.last_lines:
        lines.append(f"last {len(failure.last_lines)} line(s) of {failure.task}:")
        lines.extend(f"  | {line}" for line in failure.last_lines)
    else:
        lines.append(f"{failure.task} printed nothing.")
    if other_tasks:
        lines.append("other tasks:")
        lines.extend(f"  {line}" for line in other_tasks)
    lines.append(rule)
    return "\n".join(lines)
