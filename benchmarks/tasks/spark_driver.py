"""A Spark driver for bench_spark.py: start a session, run one runner `repeats` times, time each run().

    python spark_driver.py stratkit|peer CONFIG_JSON RESULT_PATH

"stratkit" runs stratkit.spark.SparkRunner with a Keras 3 train_fn; "peer"
runs spark-tensorflow-distributor's MirroredStrategyRunner with a legacy
Keras train_fn (the parent sets TF_USE_LEGACY_KERAS=1 for this process and
its executors). Each runner gets its own driver process, so neither's Python
state or Keras flavour touches the other. Writes a JSON result; exit 0 even
when a run fails (the failure is in the JSON), non-zero only if Spark itself
cannot start.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import spark_train  # noqa: E402

runner_name, config, result_path = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
output = {"runner": runner_name, "master": config["master"], "runs": []}


def save() -> None:
    result_path.write_text(json.dumps(output))


import cloudpickle  # noqa: E402
from pyspark import cloudpickle as spark_cloudpickle  # noqa: E402

# Ship the training functions by value: the executors have no copy of benchmarks/.
cloudpickle.register_pickle_by_value(spark_train)
spark_cloudpickle.register_pickle_by_value(spark_train)

os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession  # noqa: E402

builder = SparkSession.builder.master(config["master"]).appName(f"stratkit-bench-spark-{runner_name}")
confs = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1", "spark.ui.enabled": "false",
         "spark.ui.showConsoleProgress": "false", "spark.executor.memory": "1g",
         "spark.pyspark.python": sys.executable, **config.get("confs", {})}
for key, value in config["executor_env"].items():
    confs[f"spark.executorEnv.{key}"] = value
for key, value in confs.items():
    builder = builder.config(key, value)
start = time.time()
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
output["session_seconds"] = time.time() - start
output["spark"] = spark.version

try:
    if runner_name == "stratkit":
        from stratkit.spark import SparkRunner

        runner = SparkRunner(num_workers=config["workers"], timeout=config["timeout"])
        train, run = spark_train.train_stratkit, lambda: runner.run(train, config["epochs"], config["steps"])
    else:
        from spark_tensorflow_distributor import MirroredStrategyRunner

        runner = MirroredStrategyRunner(num_slots=config["workers"], use_gpu=False)
        train = spark_train.train_peer
        run = lambda: runner.run(train, epochs=config["epochs"], steps=config["steps"])  # noqa: E731
    for i in range(config["repeats"]):
        called = time.time()
        try:
            result = run()
            entry = {"called": called, "returned": time.time(), "result": result}
            report = getattr(runner, "last_run", None)
            if report is not None and getattr(report, "timeline", None):
                entry["timeline"] = report.timeline  # stratkit's per-phase timeline of this run
            output["runs"].append(entry)
        except Exception as exc:  # noqa: BLE001 - recorded, the parent reports it
            output["runs"].append({"called": called, "returned": time.time(),
                                   "error": f"{type(exc).__name__}: {str(exc)[-3000:]}",
                                   "traceback": traceback.format_exc()[-3000:]})
        save()
finally:
    save()
    spark.stop()
