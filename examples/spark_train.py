"""A complete SparkRunner job: a DataFrame in, 2 workers train on it, the chief's result back on the driver.

    python examples/spark_train.py                      # a local 2-slot Spark (local[2])
    spark-submit --master yarn examples/spark_train.py  # a cluster: see docs/spark.md for stagingDir
"""

import os
import sys

from pyspark.sql import SparkSession

from stratkit.spark import DataFrameInput, SparkRunner


def train_fn(data, epochs=3, per_replica_batch=16):
    """Runs in a fresh process on each executor; `data` is this worker's share of the DataFrame."""
    import stratkit

    trainer = stratkit.Trainer()  # first: MultiWorkerMirroredStrategy over the Spark tasks
    import keras

    def build_and_compile():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = trainer.build(build_and_compile)
    global_batch = per_replica_batch * trainer.num_replicas
    history = trainer.fit(model, data.dataset_fn(global_batch, model=model), epochs=epochs,
                          steps_per_epoch=data.steps_per_epoch(global_batch, trainer.num_replicas))
    return {"loss": history.history["loss"][-1], "accuracy": history.history["accuracy"][-1],
            "workers": trainer.spec.num_workers}


def main():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python, which has stratkit
    spark = SparkSession.builder.master(os.environ.get("SPARK_MASTER", "local[2]")).getOrCreate()
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [([float(v) / 16 for v in x], int(y)) for x, y in zip(digits.data, digits.target)]
    df = spark.createDataFrame(rows, "pixels array<float>, label int")

    result = SparkRunner(num_workers=2).run(train_fn, DataFrameInput(df, feature_cols=["pixels"], label_col="label"))
    print(result)  # the chief's return value
    spark.stop()


if __name__ == "__main__":
    main()
