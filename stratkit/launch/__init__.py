"""How do I start? `stratkit launch`: the user's script, unchanged, as a TF_CONFIG cluster of processes.

What torchrun is to PyTorch: one process per task (chief, workers, ps,
evaluator) with its own TF_CONFIG, prefixed live output, a root-cause report
for the first failure, whole-cluster restarts, and no orphaned process.

    from stratkit.launch import launch
    result = launch(["python", "train.py"], workers=2, max_restarts=1, log_dir="logs")
    assert result.ok, result.report

Imports no TensorFlow.
"""

from __future__ import annotations

from stratkit.launch.local import (
    RESTART_VAR,
    Attempt,
    LaunchResult,
    Task,
    TaskExit,
    TaskFailure,
    describe_returncode,
    format_failure_report,
    launch,
    plan_tasks,
    task_tf_config,
    thread_env,
)

__all__ = ["RESTART_VAR", "Attempt", "LaunchResult", "Task", "TaskExit", "TaskFailure", "describe_returncode",
           "format_failure_report", "launch", "plan_tasks", "task_tf_config", "thread_env"]
