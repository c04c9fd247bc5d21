"""Train the digits model on Spark executors with stratkit's SparkRunner (2 workers, Keras 3, MWMS).

    SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON=$PWD/.venv/bin/python \\
        .venv/bin/spark-submit --master "local-cluster[2,1,2048]" spark_jobs/train_digits.py

Each of the 2 executors runs one barrier task; each task runs `train_digits`
in a fresh Python process as one worker of a MultiWorkerMirroredStrategy
cluster. Every output line appears here prefixed `[worker:0]` / `[worker:1]`;
the chief's return value (held-out accuracy, losses, timings) is printed as
one JSON line at the end.

Executors must run a Python that has stratkit installed: PYSPARK_PYTHON (or
--conf spark.pyspark.python) must point at it, otherwise they fail with
`ModuleNotFoundError: No module named 'stratkit'`. Run with --help for options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def load_digits_split() -> tuple[Any, Any, Any, Any]:
    """sklearn's 8x8 digits as x/16 float32, split 75/25 (stratified, fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return tuple(train_test_split(x, y, test_size=0.25, random_state=0, stratify=y))  # x_tr, x_te, y_tr, y_te


def train_digits(x_train: Any, y_train: Any, x_test: Any, y_test: Any, epochs: int = 8,
                 per_replica_batch: int = 32) -> dict:
    """The training function every Spark task runs; rank 0's return value comes back to the driver."""
    import time

    import stratkit

    started = time.time()
    trainer = stratkit.Trainer()  # first: the multi-worker strategy must exist before any other TF op
    import keras
    import tensorflow as tf

    class FirstStep(keras.callbacks.Callback):
        at: float | None = None

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if self.at is None:
                self.at = time.time()

    def build_and_compile() -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build_and_compile)
    first_step = FirstStep()
    history = trainer.fit(model, (x_train, y_train), epochs=epochs, per_replica_batch_size=per_replica_batch,
                          callbacks=[first_step])
    evaluation = trainer.evaluate(model, (x_test, y_test), per_replica_batch_size=per_replica_batch)
    return {
        "accuracy": float(evaluation["accuracy"]),
        "loss": [float(v) for v in history.history["loss"]],
        "num_replicas": trainer.num_replicas,
        "task": f"{trainer.spec.task_type}:{trainer.spec.task_index}",
        "source": trainer.spec.source,
        "gpus_seen_by_tensorflow": len(tf.config.list_physical_devices("GPU")),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "process_started_at": started,
        "first_step_at": first_step.at,
    }


def session(app_name: str) -> Any:
    """The SparkSession, with the executors' Python defaulting to this interpreter."""
    # pyspark reads PYSPARK_PYTHON when the context starts: without it, executors run `python3`.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if os.environ.get("SPARK_LOCAL_IP"):  # the hostname may resolve to an interface executors cannot reach
        builder = builder.config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
    return builder.getOrCreate()


def main(argv: list[str] | None = None, *, use_gpu: bool = False) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Spark barrier tasks = TF workers (default 2)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="per-replica batch size")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the run is killed")
    if use_gpu:
        parser.add_argument("--gpus-per-worker", type=int, default=None, help="default: all the task's GPUs")
    args = parser.parse_args(argv)

    from stratkit.spark import SparkRunner

    spark = session("stratkit-train-digits" + ("-gpu" if use_gpu else ""))
    x_train, x_test, y_train, y_test = load_digits_split()
    runner = SparkRunner(num_workers=args.workers, use_gpu=use_gpu, timeout=args.timeout,
                         gpus_per_worker=getattr(args, "gpus_per_worker", None))
    started = time.time()
    result = runner.run(train_digits, x_train, y_train, x_test, y_test, epochs=args.epochs,
                        per_replica_batch=args.batch)
    wall = time.time() - started
    summary = {
        "accuracy": round(result["accuracy"], 4),
        "final_loss": round(result["loss"][-1], 4),
        "num_replicas": result["num_replicas"],
        "chief": result["task"],
        "source": result["source"],
        "cuda_visible_devices_on_chief": result["cuda_visible_devices"],
        "gpus_seen_by_tensorflow_on_chief": result["gpus_seen_by_tensorflow"],
        "run_seconds": round(wall, 1),
        "first_step_seconds": round(result["first_step_at"] - started, 1) if result["first_step_at"] else None,
        "stage": runner.last_run.stage if runner.last_run else None,
    }
    print(json.dumps(summary), flush=True)
    spark.stop()
    return summary


if __name__ == "__main__":
    main()
