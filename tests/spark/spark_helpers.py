"""Helpers for tests/spark: real Spark sessions (one per module: a JVM start costs 10-20 s).

Every session binds loopback (this machine's hostname resolves to another
interface) and runs its executors with this interpreter (in local-cluster
mode they start their own Python; the system one lacks stratkit).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from procs import alive  # noqa: F401 - re-exported: the Spark tests' one liveness check

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_GPU_SCRIPT = REPO_ROOT / "spark_jobs" / "gpu_discovery.sh"

#: Confs every test session gets.
BASE_CONFS: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.executor.memory": "512m",
    "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "2",
    "spark.sql.shuffle.partitions": "2",
}


def start_session(master: str, confs: Mapping[str, str] = ()) -> Iterator:
    """Yield a SparkSession for `master`; stop it (and restore the environment) afterwards."""
    pytest.importorskip("pyspark")
    stop_shared_session()  # one SparkContext per driver: a kept session must go before another starts
    saved = {k: os.environ.get(k) for k in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable  # pyspark reads it when the context starts
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("stratkit-tests")
    # The executors' Python imports this checkout's stratkit, not the one installed in the venv (which may be
    # another worktree's): without it a worktree's tests ran the tasks' side of its change from main.
    executor_path = {"spark.executorEnv.PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    for key, value in {**BASE_CONFS, **executor_path, **dict(confs)}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_SHARED: dict = {}


def shared_session(master: str, confs: Mapping[str, str] = ()):
    """The SparkSession for `master` and `confs`, kept after its module for the next module asking for the same
    ones (tests/spark/conftest.py puts those modules next to each other), so their executors and Python workers
    start once (measured: 25-50 s a session on a loaded 2-core machine). Any other session stops it first;
    tests/spark/conftest.py stops it at the end of the test session."""
    key = (master, tuple(sorted(dict(confs).items())))
    if _SHARED.get("key") != key:
        stop_shared_session()
        sessions = start_session(master, confs)
        _SHARED.update(key=key, sessions=sessions, session=next(sessions))
    return _SHARED["session"]


def stop_shared_session() -> None:
    """Stop the kept session, if any (its start_session's cleanup: spark.stop() and the environment back)."""
    sessions = _SHARED.get("sessions")
    _SHARED.clear()
    if sessions is not None:
        sessions.close()


def processes_of_run(run_id: str) -> list[int]:
    """PIDs of live processes of this run: its training processes (named after the run, as their run arrives
    after they start) and anything they started (their environment carries the run's id)."""
    from stratkit.spark.child import process_name

    marker = f"STRATKIT_SPARK_RUN={run_id}".encode()
    name = process_name(run_id).encode()
    return [pid for pid in _live_pids()
            if _read(pid, "comm").strip() == name or marker in _read(pid, "environ").split(b"\0")]


def standby_processes() -> list[int]:
    """PIDs of live warm standby training processes (any session's)."""
    from stratkit.spark.child import STANDBY_NAME

    return [pid for pid in _live_pids() if _read(pid, "comm").strip() == STANDBY_NAME.encode()[:15]]


def _live_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _read(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read()
    except OSError:
        return b""
