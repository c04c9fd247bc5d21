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
    saved = {k: os.environ.get(k) for k in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable  # pyspark reads it when the context starts
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("stratkit-tests")
    for key, value in {**BASE_CONFS, **dict(confs)}.items():
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


def processes_of_run(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries this run's id (its training processes)."""
    marker = f"STRATKIT_SPARK_RUN={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found
