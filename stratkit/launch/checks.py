"""Argument checks of `stratkit launch`: every bad value fails before anything starts, naming the flag and the fix.

Imports no TensorFlow.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from stratkit import storage
from stratkit.errors import ConfigError


def check_count(value: Any, flag: str, minimum: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag} must be a whole number >= {minimum}: got {value!r}. Fix: e.g. {flag} {example}")
    return value


def check_seconds(value: Any, flag: str, example: float, positive: bool = False) -> None:
    """A duration must be a real number of seconds: nan compares false with everything and inf never ends."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        if positive:
            raise ConfigError(f"{flag} must be a positive number of seconds: got {value!r} (a finite number > 0; "
                              f"omit {flag} for no limit). Fix: e.g. {flag} {example:g}")
        raise ConfigError(f"{flag} must be a finite number of seconds >= 0: got {value!r}. Fix: e.g. {flag} "
                          f"{example:g}")


#: Open files the launcher needs whatever the layout (its own streams, events.jsonl, the reaper's pipe, ...).
_BASE_FILES = 32


def check_task_limit(tasks: int, serving: int, workers: int, ps: int, base_port: int | None, logs: bool) -> None:
    """Refuse, before anything is bound or started, more tasks than this machine lets the launcher supervise.

    `tasks` processes in all, `serving` of them with a gRPC server. Two limits apply to a
    one-machine cluster: the launcher's open files (per task: its stdout and stderr pipes, its
    held port, its log file) under `ulimit -n`; and one port per serving task, from the
    kernel's range of free ports (`base_port` has its own check).
    """
    # (tasks that count, at most, why, how to raise it)
    limits: list[tuple[int, int, str, str]] = []
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # not POSIX: no such limit to check
        soft = -1
    if soft > 0:  # RLIM_INFINITY is -1
        per_task = 3 + logs
        what = "its output pipes, its port until it listens" + (", its log file" if logs else "")
        limits.append((tasks, (soft - _BASE_FILES) // per_task,
                       f"the launcher holds {per_task} open files per task ({what}) and its open-file limit "
                       f"(ulimit -n) is {soft}", "raise the limit (ulimit -n), or "))
    if base_port is None:
        low, high = _local_port_range()
        limits.append((serving, high - low + 1, f"each task's gRPC server needs its own port, and the kernel "
                       f"hands out {high - low + 1} free ports (net.ipv4.ip_local_port_range {low} {high})", ""))
    for count, limit, why, raise_it in sorted(limits, key=lambda x: x[1]):
        if count > limit:
            flag, value = ("--ps", ps) if ps > workers else ("--workers", workers)
            raise ConfigError(f"{flag} {value}: {tasks} tasks on this machine are more than it can run: {why}, "
                              f"so at most {max(limit, 0)} tasks. Fix: {raise_it}run fewer tasks per machine, or "
                              "spread the cluster over several machines (--hosts h1,h2,... --print-tf-config)")


def _local_port_range() -> tuple[int, int]:
    """The kernel's range of ports handed out by bind(port 0); Linux's default when unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(x) for x in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def check_not_in_slurm_step(env: Mapping[str, str]) -> None:
    """Refuse to run inside a multi-task srun step, where every task would start a cluster of its own."""
    from stratkit.cluster import slurm

    if slurm.is_slurm_step(env):
        raise ConfigError(
            f"stratkit launch is running inside an srun step of SLURM_STEP_NUM_TASKS="
            f"{env.get('SLURM_STEP_NUM_TASKS')} tasks: each of them would start its own local cluster and train "
            "separately. Fix: let Slurm start the tasks, `srun --ntasks=N python train.py` (stratkit.detect() "
            "builds the cluster from the Slurm step), or run the launcher in a one-task step "
            "(`srun --ntasks=1 stratkit launch --workers N -- python train.py`) for a one-node cluster")


def check_command(command: Sequence[str], path: str | None = None) -> list[str]:
    """The command to run, with a leading `--` dropped; clear errors when empty or not found."""
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("missing the command to run. Fix: put it after --, e.g. "
                          "`stratkit launch --workers 2 -- python train.py`")
    program = argv[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError(f"the command {program!r} is not an executable file. Fix: check the path "
                              "(or run a script through its interpreter: -- python train.py)")
    elif shutil.which(program, path=path) is None:
        raise ConfigError(f"the command {program!r} was not found on PATH. Fix: check the spelling, activate "
                          f"the environment that has it, or give its full path (e.g. {sys.executable})")
    return argv


def check_log_dir(log_dir: str | os.PathLike[str] | None) -> str | None:
    """`--log-dir` as a local directory (a ``file://`` URL becomes its path), or None.

    A store URL is refused: the launcher appends each task's output to its file
    as the lines come, and an object in a store is only ever written whole.

    Raises:
        ConfigError: a store URL, or a path that would be a local directory named after a scheme (``s3:/b``).
    """
    if not log_dir:
        return None
    text = os.fspath(log_dir)
    if storage.is_url(text):
        raise ConfigError(f"--log-dir {storage.redact(text)!r} is a store URL, but the launcher appends each task's "
                          "output to its log file line by line, which an object store cannot do (an object is "
                          "written whole). Fix: --log-dir with a local directory (e.g. --log-dir logs), and copy it "
                          "to the store after the run")
    return storage.local_path(text, "--log-dir")
