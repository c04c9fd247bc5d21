"""How a failed Ray run is told: `RayTrainingError`, a summary line, then the root-cause report.

The same format as `SparkTrainingError` and `stratkit launch`: the report is
`stratkit.process.report.format_failure_report` (title "stratkit ray"), the
tail `stratkit.process.pump`'s, return codes worded by `describe_returncode`.
What is Ray's own is how a task can end: its process exits (an exit code), or
its actor dies with the node it ran on (no exit code; the node is named).

Pure Python: no Ray, no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stratkit.errors import StratkitError
from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report, is_preempted

#: Who reports in the root-cause report.
REPORT_TITLE = "stratkit ray"


class RayTrainingError(StratkitError, RuntimeError):
    """Training on Ray failed: which task, how it ended, its last output lines.

    Attributes:
        task: the failing task's label ("worker:1"), None for a timeout.
        rank: its position in the run's task list (0 is the chief), or None.
        exit_code: its training process's exit code (negative: killed by that signal), or None
            (its actor or node was lost, or the run timed out).
        node: the address of the Ray node the task ran on, when known.
        lines: its last output lines (up to `stratkit.process.pump.TAIL_LINES`).
        attempt: the attempt that failed (1-based).
        timed_out: True when `timeout` ended the run.
        lost: True when the task's actor died (its node or its worker process was lost).
        lost_nodes: Ray's node ids of the nodes whose tasks were lost in that attempt (a retry with
            `min_workers` waits for Ray's verdict on them before it counts the nodes).
    """

    def __init__(self, message: str, *, task: str | None = None, rank: int | None = None,
                 exit_code: int | None = None, node: str | None = None, lines: Sequence[str] = (),
                 attempt: int | None = None, timed_out: bool = False, lost: bool = False,
                 lost_nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.task = task
        self.rank = rank
        self.exit_code = exit_code
        self.node = node
        self.lines = list(lines)
        self.attempt = attempt
        self.timed_out = timed_out
        self.lost = lost
        self.lost_nodes = list(lost_nodes)

    @property
    def preempted(self) -> bool:
        """The attempt ended on a preemption notice: the first task to end exited 75 after writing its backup
        (the others stop at the same step); `RayRunner` re-runs it without counting against max_retries."""
        return is_preempted(self.exit_code) and not self.lost


@dataclass
class TaskState:
    """What the driver knows about one task of an attempt."""

    label: str
    rank: int
    node: str
    node_id: str = ""  # Ray's id of that node
    pid: int | None = None
    exit_code: int | None = None
    lost: str | None = None  # why its actor is gone (Ray's error, first line)
    lines: list[str] = field(default_factory=list)
    exception: tuple[str, ...] = ()


def _others(states: Sequence[TaskState], failed: TaskState | None, when: str) -> list[str]:
    lines = []
    for state in states:
        if state is failed:
            continue
        head = f"{state.label} (rank {state.rank}, node {state.node}): "
        if state.lost is not None:
            lines.append(head + f"lost ({state.lost})")
        elif state.exit_code is None:
            last = state.lines[-1:] or ["(no output)"]
            lines.append(head + f"still running {when}: stopped by the runner; its last line: {last[0]}")
        else:
            lines.append(head + describe_returncode(state.exit_code))
    return lines


def task_failed(state: TaskState, states: Sequence[TaskState], attempt: int, attempts: int) -> RayTrainingError:
    """A task's training process exited with a non-zero code, or its actor (its node) was lost."""
    which = f"attempt {attempt} of {attempts}"
    if state.lost is not None:
        ended = (f"its Ray actor died: the node {state.node} or the actor's worker process was lost "
                 f"(Ray: {state.lost})")
        how = f"was lost with node {state.node}"
    elif is_preempted(state.exit_code):
        ended = None
        how = (f"was preempted on node {state.node}: it stopped on a preemption notice, wrote its backup and "
               f"exited {state.exit_code}")
    else:
        ended = None
        how = f"failed with exit code {state.exit_code} on node {state.node}"
    failure = TaskFailure(state.label, state.exit_code, tuple(state.lines), pid=state.pid, address=state.node,
                          attempt=attempt - 1, exception=state.exception, ended=ended)
    report = format_failure_report(failure, _others(states, state, f"after {state.label} failed"),
                                   attempts=attempts, title=REPORT_TITLE)
    rest = "stopped at the same step" if is_preempted(state.exit_code) else "were stopped"
    return RayTrainingError(f"task {state.label} (rank {state.rank}) {how} ({which}); the other tasks {rest}.\n"
                            f"{report}", task=state.label, rank=state.rank, exit_code=state.exit_code,
                            node=state.node, lines=state.lines, attempt=attempt, lost=state.lost is not None,
                            lost_nodes=sorted({s.node_id for s in states if s.lost is not None and s.node_id}))


def timed_out(states: Sequence[TaskState], timeout: float | None, attempt: int, attempts: int) -> RayTrainingError:
    """`timeout` passed: the report is the chief's (rank 0), the others as they were."""
    chief = states[0]
    failure = TaskFailure(chief.label, None, tuple(chief.lines), pid=chief.pid, address=chief.node,
                          attempt=attempt - 1, timed_out_after=timeout, timeout_setting="timeout=",
                          exception=chief.exception)
    report = format_failure_report(failure, _others(states, chief, "at the timeout"), attempts=attempts,
                                   title=REPORT_TITLE)
    return RayTrainingError(f"training did not finish within timeout={timeout}s (attempt {attempt} of {attempts}); "
                            f"every task was stopped.\n{report}", attempt=attempt, timed_out=True)
