"""How a failed Spark attempt is told: `SparkTrainingError`, a summary line, then the launcher's root-cause report.

One format for both front doors: the report is
`stratkit.process.report.format_failure_report` (title "stratkit spark";
`stratkit launch` prints it as "stratkit launch"), the tail is
`stratkit.process.pump`'s (the last 50 lines, each cut to 8,000 characters),
and return codes are worded by `describe_returncode`. The summary line before
the report stays short and stable: the retry message quotes it.

Pure Python: no pyspark, no TensorFlow.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from stratkit.errors import StratkitError
from stratkit.process.pump import TAIL_LINES
from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report, is_preempted
from stratkit.spark.layout import TaskRole
from stratkit.spark.logprotocol import SETUP_FAILED
from stratkit.spark.logserver import LogServer, TaskLog
from stratkit.spark.task import parse_failure_record

#: Who reports in the root-cause report (the launcher's says "stratkit launch").
REPORT_TITLE = "stratkit spark"


class SparkTrainingError(StratkitError, RuntimeError):
    """Training on Spark failed: which task, its exit code and its last output lines.

    Attributes:
        task: the failing task's label ("worker:1"), None for a timeout or a
            failure before any training process ran.
        rank: its barrier rank, or None.
        exit_code: its training process's exit code (negative: killed by that
            signal), or None.
        lines: its last output lines (up to `stratkit.process.pump.TAIL_LINES`, 50: the launcher's tail).
        attempt: the attempt that failed (1-based).
        timed_out: True when `timeout` ended the run.
    """

    def __init__(self, message: str, *, task: str | None = None, rank: int | None = None,
                 exit_code: int | None = None, lines: Sequence[str] = (), attempt: int | None = None,
                 timed_out: bool = False) -> None:
        super().__init__(message)
        self.task = task
        self.rank = rank
        self.exit_code = exit_code
        self.lines = list(lines)
        self.attempt = attempt
        self.timed_out = timed_out

    @property
    def preempted(self) -> bool:
        """The attempt ended on a preemption notice: the first task to end exited 75 after writing its backup
        (the others stop at the same step); `SparkRunner` re-runs it without counting against max_retries."""
        return is_preempted(self.exit_code)


@dataclass
class AttemptState:
    """What the driver learned while one attempt ran (set from the log server's and the timer's threads)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    failure: TaskLog | None = None  # the first task that reported a non-zero exit
    timed_out: bool = False
    finished: bool = False
    server_failure: str | None = None  # why the log server stopped accepting (LogServer.on_fatal)


def explain(error: BaseException, state: AttemptState, server: LogServer, roles: Sequence[TaskRole], attempt: int,
            attempts: int, timeout: float | None) -> SparkTrainingError:
    """The attempt's failure as a SparkTrainingError: a one-line summary, then the root-cause report.

    The report is `stratkit.process.report.format_failure_report`, the
    launcher's format: the failed task, how it ended, the exception it died
    of, its last lines (`stratkit.process.pump`'s tail), what became of the others.
    """
    which = f"attempt {attempt} of {attempts}"

    def report(failure: TaskFailure, others: Sequence[str] = ()) -> str:
        return format_failure_report(failure, others, attempts=attempts, title=REPORT_TITLE)

    if state.timed_out:
        primary = server.tasks.get(0)
        failure = TaskFailure(roles[0].label, None, primary.tail.lines() if primary else (),
                              attempt=attempt - 1, timed_out_after=timeout, timeout_setting="timeout=",
                              exception=primary.scanner.exception if primary else ())
        return SparkTrainingError(f"training did not finish within timeout={timeout}s ({which}); every "
                                  f"task was killed and the Spark job cancelled.\n"
                                  + report(failure, other_tasks(roles, server, 0, "at the timeout")),
                                  attempt=attempt, timed_out=True)
    if state.server_failure is not None:
        return SparkTrainingError(f"{which} was stopped (every task killed, the Spark job cancelled) because "
                                  f"{state.server_failure}", attempt=attempt)
    text = str(error)
    failed = state.failure
    if failed is not None:
        label, rank, code = failed.label, failed.rank, failed.exit_code
        lines, exception = list(failed.tail), failed.scanner.exception
    elif (record := parse_failure_record(text)) is not None:
        # the log server never heard the exit: the task's own record travels in Spark's error
        label, rank, code = record["label"], record["rank"], record["exit_code"]
        lines, exception = list(record["lines"])[-TAIL_LINES:], ()
    else:
        return stage_failed(text, attempt, attempts)
    failure = TaskFailure(label, code, tuple(lines), attempt=attempt - 1, exception=exception,
                          ended=ended(code))
    how = "failed before its training process started" if code == SETUP_FAILED else (
        "was lost: its connection to the driver ended without an exit code" if code is None else
        f"was preempted: it stopped on a preemption notice, wrote its backup and exited {code}" if is_preempted(code)
        else f"failed with exit code {code}")
    rest = ("the other tasks stopped at the same step" if is_preempted(code) else "the other tasks were stopped")
    return SparkTrainingError(
        f"task {label} (rank {rank}) {how} ({which}); {rest}.\n"
        + report(failure, other_tasks(roles, server, rank, f"after {label} failed")),
        task=label, rank=rank, exit_code=code, lines=lines, attempt=attempt)


def stage_failed(text: str, attempt: int, attempts: int) -> SparkTrainingError:
    """Spark failed the stage before any training process reported: what Spark said, in the report's format."""
    hint = ""
    if "ModuleNotFoundError" in text or "No module named" in text:
        hint = (f"\nFix: the executors' Python cannot import a module (see above). Point them at the "
                f"interpreter that has stratkit installed: set PYSPARK_PYTHON={sys.executable} before the "
                "SparkSession starts (spark.pyspark.python with spark-submit), or install the module there")
    lines = tail_lines(text, TAIL_LINES)
    failure = TaskFailure("the Spark stage", None, tuple(lines), attempt=attempt - 1,
                          ended="Spark failed the barrier stage before a training process reported its exit")
    report = format_failure_report(failure, attempts=attempts, title=REPORT_TITLE)
    return SparkTrainingError(f"the Spark barrier stage failed before a training process reported its exit "
                              f"(attempt {attempt} of {attempts}); what Spark said:\n"
                              + report + hint, lines=lines, attempt=attempt)


def first_line(error: BaseException) -> str:
    """The error's summary line (what the retry message quotes)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def ended(code: int | None) -> str | None:
    """How a task ended in words, where the return code's wording (`describe_returncode`) does not apply."""
    if code is None:
        return ("ended without reporting an exit code: its process, its executor or its host is gone "
                "(killed, out of memory, or the machine lost)")
    if code == SETUP_FAILED:
        return "the task failed before its training process started"
    return None


def other_tasks(roles: Sequence[TaskRole], server: LogServer, failed_rank: int | None, when: str) -> list[str]:
    """One line per task but the failed one for the report: how it ended, as the driver heard it."""
    lines = []
    for role in roles:
        if role.rank == failed_rank:
            continue
        task = server.tasks.get(role.rank)
        head = f"{role.label} (rank {role.rank}): "
        if task is None:
            lines.append(head + "never connected to the driver's log server")
        elif task.exit_code is None:
            last = list(task.tail)[-1:] or ["(no output)"]
            lines.append(head + f"still running {when}: stopped by the runner; its last line: {last[0]}")
        elif task.exit_code == -signal.SIGKILL:  # how a task kills its process tree on the driver's ABORT
            lines.append(head + f"stopped by the runner {when} (SIGKILL)")
        else:
            lines.append(head + (ended(task.exit_code) or describe_returncode(task.exit_code)))
    return lines


def tail_lines(text: str, count: int) -> list[str]:
    """The last `count` lines of Spark's error text, without blank lines and JVM frames ("at ...")."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("at ")]
    return lines[-count:]
