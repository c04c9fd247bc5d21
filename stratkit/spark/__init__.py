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
* `KerasEstimator` / `KerasModel` -- Spark ML stages (`stratkit.spark.ml`):
  `fit(df)` trains on the executors with `SparkRunner`, `transform(df)`
  scores there; they sit in a `Pipeline`, save and load with it, and tune in
  `CrossValidator`. `keras_predict(df, "model.keras", ...)` scores with any
  saved Keras model.

Importing this package imports neither pyspark nor TensorFlow; pyspark is
imported when a runner or a stage is used (the stages load on first access),
TensorFlow only where a model is trained or loaded.
"""

from __future__ import annotations

from typing import Any

from stratkit.spark.data import DataFrameInput, ParquetShard
from stratkit.spark.mirrored import MirroredStrategyRunner
from stratkit.spark.runner import RunReport, SparkRunner, SparkTrainingError

__all__ = ["DataFrameInput", "KerasEstimator", "KerasModel", "MirroredStrategyRunner", "ParquetShard", "RunReport",
           "SparkRunner", "SparkTrainingError", "keras_predict"]

#: Names that load `stratkit.spark.ml` (and so pyspark.ml) on first access.
_ML_NAMES = ("KerasEstimator", "KerasModel", "keras_predict")


def __getattr__(name: str) -> Any:
    if name in _ML_NAMES:
        from stratkit.spark import ml

        return getattr(ml, name)
    raise AttributeError(f"module 'stratkit.spark' has no attribute {name!r}")
