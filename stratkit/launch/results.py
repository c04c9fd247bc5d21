"""What a launch returns (`LaunchResult`, one `Attempt` per start of the cluster, one `TaskExit` per task)
and the report printed when it failed.

Imports no TensorFlow.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report, is_preempted
from stratkit.status import EXIT_PREEMPTED

#: What a script prints when it needs a network the private namespace does not have.
_NETWORK_ERRORS = ("Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
                   "No route to host", "Could not resolve host", "nodename nor servname", "No address associated",
                   "the store could not be reached",   # stratkit.storage's words: a backup_dir or path URL
                   # pyarrow's S3 client (curl) finding nothing at a store's address: a store on this machine's
                   # loopback (moto, MinIO) is not on the private network's
                   "Could not connect to server", "Couldn't connect to server", "NETWORK_CONNECTION")


@dataclass(frozen=True)
class TaskExit:
    """How one task of one attempt ended.

    `stopped` says why the launcher stopped it ("failure", "timeout",
    "interrupt", "after_success", "preempted"), or is None when it exited on its own.
    """

    task: str
    pid: int
    returncode: int
    address: str | None = None
    stopped: str | None = None


@dataclass(frozen=True)
class Attempt:
    """One start of the whole cluster. `outcome`: "succeeded", "failed", "timed_out", "interrupted",
    "preempted" (a task exited 75 after its preemption backup: restarted without counting a failure), or
    "resized" (--nnodes MIN:MAX: the membership changed, every node starts again; not a failure)."""

    number: int
    outcome: str
    tasks: tuple[TaskExit, ...]
    seconds: float
    failure: TaskFailure | None = None
    after_success: bool = False


@dataclass(frozen=True)
class LaunchResult:
    """What `launch()` returns: the launcher's exit code and every attempt.

    `report` is the printed root-cause report when the launch failed;
    `interrupted_by` the signal that stopped the launcher, if one did.
    """

    returncode: int
    attempts: tuple[Attempt, ...]
    report: str = ""
    interrupted_by: int | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def root_cause(self) -> TaskFailure | None:
        """The last attempt's first failure (None on success or interrupt)."""
        return self.attempts[-1].failure if self.attempts else None

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)


def saved_and_exited(attempt: Attempt) -> bool:
    """True when every task of `attempt` exited 75: each wrote its preemption backup (the launcher was preempted)."""
    return bool(attempt.tasks) and all(is_preempted(t.returncode) for t in attempt.tasks)


def preempted_note(attempt: Attempt, signum_name: str, seconds: float) -> str:
    """The launcher's last line when it was preempted itself and every task saved its backup."""
    return (f"preempted: {signum_name} reached the launcher; every task stopped at the same step, wrote its backup "
            f"and exited {EXIT_PREEMPTED} ({seconds:.1f} s); exiting {EXIT_PREEMPTED} (preempted) so the job is "
            "started again, and it resumes from the backup")


def exit_code(attempt: Attempt) -> int:
    """The launcher's exit code for a failed last attempt: as a shell would report the failed task."""
    failure = attempt.failure
    assert failure is not None
    if attempt.outcome == "timed_out":
        code = 124  # as timeout(1)
    elif failure.returncode is not None and failure.returncode < 0:
        code = 128 - failure.returncode  # as a shell reports a death by signal
    else:
        code = failure.returncode or 1
    return min(code, 255)


def failure_report(attempts: Sequence[Attempt], total: int, primary: str, stop_grace: float,
                   private_network: bool, title: str = "stratkit launch") -> str:
    """The root-cause report of a launch whose last attempt failed, with notes on restarts and the network.

    Args:
        attempts: every attempt so far; the last one failed.
        total: attempts allowed (restarts + 1).
        primary: the task whose success ends training ("chief:0" or "worker:0").
        stop_grace: --stop-grace, to say how the other tasks were stopped.
        private_network: the tasks ran in the private network (a network error then gets a hint).
        title: who reports (`stratkit.LocalRunner` passes its own).
    """
    last = attempts[-1]
    failure = last.failure
    assert failure is not None
    others = [describe_other(t, failure.task, stop_grace) for t in last.tasks if t.task != failure.task]
    report = format_failure_report(failure, others, attempts=total, title=title)
    if private_network:
        report += network_hint(failure)
    if last.after_success:
        report += f"\n{primary} had finished training: not restarted (a restart would train again)."
    earlier = "; ".join(f"attempt {a.number + 1}: {a.failure.task} {a.failure.reason}"
                        for a in attempts[:-1] if a.failure is not None)
    if earlier:  # (an elastic launch's membership changes end attempts without a failure)
        report += f"\nearlier attempts: {earlier}"
    return report


def describe_other(exit_: TaskExit, failed: str, stop_grace: float) -> str:
    """One line of the report on a task that did not fail first: how it ended."""
    head = f"{exit_.task} (pid {exit_.pid}): "
    if exit_.stopped in ("failure", "timeout", "preempted"):
        why = {"failure": f"after {failed} failed", "timeout": "at the timeout",
               "preempted": f"after {failed} was preempted"}[exit_.stopped]
        if exit_.returncode == -signal.SIGKILL:
            how = f"SIGTERM, then SIGKILL after --stop-grace {stop_grace:g} s"
        elif exit_.returncode == -signal.SIGTERM:
            how = "SIGTERM"
        else:  # e.g. a TF task that handles SIGTERM as a preemption notice and exits on its own
            how = f"SIGTERM; it then {describe_returncode(exit_.returncode)}"
        return head + f"stopped by the launcher {why} ({how})"
    if exit_.stopped == "after_success":
        return head + "stopped by the launcher after the chief finished"
    return head + describe_returncode(exit_.returncode)


def network_hint(failure: TaskFailure) -> str:
    """A note for a failure in the private network that looks like its price (no DNS, no route), else ""."""
    text = "\n".join(failure.exception + failure.last_lines)
    if not any(p in text for p in _NETWORK_ERRORS):
        return ""
    return ("\nnote: the tasks ran in a private network with loopback only (stratkit launch's default), and "
            "this failure looks like a network error. If the script needs the network (downloads, remote "
            "storage, an experiment tracker, a service on this machine), fetch what it needs before "
            "launching, or rerun with --no-private-network behind a firewall that blocks the task ports "
            "from other machines.")
