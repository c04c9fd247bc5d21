"""How do I start on Spark? The same training function on Spark executors, as a TensorFlow cluster.

    from stratkit.spark import SparkRunner
    accuracy = SparkRunner(num_workers=2).run(train_fn, epochs=5)

* `SparkRunner` -- one barrier task per TF task; TF_CONFIG from the barrier
  task addresses (validated by `stratkit.detect`), GPUs from Spark's resource
  scheduling, train_fn in a fresh process per task, every output line streamed
  to the driver as `[worker:1] ...`, the chief's return value back on the
  driver, `SparkTrainingError` with the failing task's last lines, retries and
  a timeout. DataFrame arguments arrive as per-worker `ParquetShard`s.
* `MirroredStrategyRunner` -- a drop-in for spark-tensorflow-distributor's,
  on the same machinery, with Keras 3 multi-worker training working.

Importing this package imports neither pyspark nor TensorFlow; pyspark is
imported when a runner is used, TensorFlow only inside the training processes.
"""

from __future__ import annotations

from stratkit.spark.data import DataFrameInput, ParquetShard
from stratkit.spark.mirrored import MirroredStrategyRunner
from stratkit.spark.runner import RunReport, SparkRunner, SparkTrainingError

__all__ = ["DataFrameInput", "MirroredStrategyRunner", "ParquetShard", "RunReport", "SparkRunner",
           "SparkTrainingError"]
