"""The tuning benchmark's search on an engine's 2 tuners: `python tune_engines.py spark|ray --trials T --epochs E`.

`SparkRunner(num_workers=2, tune=True)` on a local Spark (`local[2]`, loopback) or `RayRunner(num_workers=2,
tune=True)` on a local Ray (2 CPUs, loopback, token authentication) runs benchmarks/tasks/tune_task.py's `report`
as each tuner; every tuner's `TUNE {...}` line reaches this driver's output (prefixed `[tuner:N]`), which
benchmarks/bench_tuning.py reads as it reads `stratkit launch --tune`'s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune_task  # noqa: E402

# The executors and actors import neither benchmarks/ nor examples/: both modules travel by value.
cloudpickle.register_pickle_by_value(tune_task)
cloudpickle.register_pickle_by_value(tune_task.example)


def spark(trials: int, epochs: int, search: str) -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from stratkit.spark import SparkRunner

    session = (SparkSession.builder.master("local[2]").appName("bench-tuning")
               .config("spark.driver.host", "127.0.0.1").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        SparkRunner(num_workers=2, tune=True, spark=session).run(tune_task.report, trials, epochs, search=search)
    finally:
        session.stop()


def ray_(trials: int, epochs: int, search: str) -> None:
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                       "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    import ray
    import ray.cloudpickle

    from stratkit.ray import RayRunner

    for module in (tune_task, tune_task.example):
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False)
    try:
        RayRunner(num_workers=2, tune=True).run(tune_task.report, trials, epochs, search=search)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=("spark", "ray"))
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--search", choices=("random", "hyperband"), default="random")
    args = parser.parse_args()
    (spark if args.engine == "spark" else ray_)(args.trials, args.epochs, args.search)
