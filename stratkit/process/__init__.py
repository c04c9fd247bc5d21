"""The process layer under both front doors, `stratkit launch` and `stratkit.spark`: start, follow, stop, report.

One module per job (as torch's `distributed/elastic/multiprocessing/`):

- `ports`: hold a task's port until its TensorFlow server listens; is it listening yet;
- `children`: start (or fork) a child in its own process group that dies with us; stop groups;
- `reaper`: the process that kills our children's groups when we end, however we end;
- `pump`: follow a child's output line by line, with a prefix, a tail and its last exception;
- `tracebacks`: find that exception in the output;
- `report`: return codes in words, and the root-cause report.

What a task is, where it runs and what TF_CONFIG it gets is not decided
here: that is `stratkit.cluster.layout` (the rule) and each front door (the placing).

Pure Python: imports no TensorFlow.
"""

from __future__ import annotations

from stratkit.process.children import die_with_parent, fork_child, kill_group, start_child, stop_groups
from stratkit.process.ports import hold_port, is_listening, listening_ports
from stratkit.process.pump import TAIL_LINES, Line, OutputPump, Tail, prefixed
from stratkit.process.reaper import Reaper
from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report, signal_name
from stratkit.process.tracebacks import ExceptionScanner, last_exception

__all__ = ["TAIL_LINES", "ExceptionScanner", "Line", "OutputPump", "Reaper", "Tail", "TaskFailure",
           "describe_returncode", "die_with_parent", "fork_child", "format_failure_report", "hold_port", "is_listening",
           "kill_group", "last_exception", "listening_ports", "prefixed", "signal_name", "start_child",
           "stop_groups"]
