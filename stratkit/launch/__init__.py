"""How do I start? `stratkit launch`: the user's script, unchanged, as a TF_CONFIG cluster of processes.

What torchrun is to PyTorch: one process per task (chief, workers, ps,
evaluator) with its own TF_CONFIG, prefixed live output, a root-cause report
for the first failure, whole-cluster restarts, and no orphaned process.

    from stratkit.launch import launch
    result = launch(["python", "train.py"], workers=2, max_restarts=1, log_dir="logs")
    assert result.ok, result.report

Public: `launch`, what it returns (`LaunchResult`, its `Attempt`s, their
`TaskExit`s and `TaskFailure`) and `RESTART_VAR`, the variable each task
reads to know its restart; `LocalTrainingError` and `LocalRunReport`, what
`stratkit.LocalRunner` (`launch/runner.py`: the cluster runners' `run(train_fn)`
on this machine, on the same machinery) raises and records. The other names the first version exported
(`plan_tasks`, `describe_returncode`, ...: see `_MOVED`) still import from
here, from the modules that own them now.

Imports no TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratkit.launch.local import launch
from stratkit.launch.plan import RESTART_VAR
from stratkit.launch.results import Attempt, LaunchResult, TaskExit
from stratkit.launch.runner import LocalRunReport, LocalTrainingError
from stratkit.process.report import TaskFailure

__all__ = ["RESTART_VAR", "Attempt", "LaunchResult", "LocalRunReport", "LocalTrainingError", "TaskExit", "TaskFailure",
           "launch"]

_MOVED = {
    "Task": "stratkit.launch.plan",
    "plan_tasks": "stratkit.launch.plan",
    "task_tf_config": "stratkit.launch.plan",
    "thread_env": "stratkit.launch.plan",
    "describe_returncode": "stratkit.process.report",
    "format_failure_report": "stratkit.process.report",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'stratkit.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
