"""A Spark ML job with a Keras model: a DataFrame in, a Pipeline fitted on the executors, saved, a DataFrame scored.

    SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON=$PWD/.venv/bin/python \\
        .venv/bin/spark-submit --master "local-cluster[2,1,2048]" spark_jobs/pipeline_job.py --out /tmp/job

The two halves of a production setup in one run (or one each: `fit`, `score`):
  fit    the diabetes table (scikit-learn's bundled copy: 442 rows, 10 columns) as a DataFrame;
         Pipeline([VectorAssembler, StandardScaler, KerasEstimator]) fitted with the Keras model trained
         on 2 executors (stratkit's SparkRunner: MultiWorkerMirrored, every row once per epoch);
         the PipelineModel saved to OUT/pipeline, and its predictions on the table to OUT/fitted.
  score  a SparkSession of its own (in `all`, the fitting one is stopped first, as a separate scoring job
         would start) loads OUT/pipeline and scores the DataFrame on the executors (the model loaded once
         per Python worker); the predictions go to OUT/scored (Parquet).
It prints one JSON line: rows, the RMSE on the validation rows and on the whole table, and how long each
half took.

Executors need a Python with stratkit installed (PYSPARK_PYTHON, or --conf spark.pyspark.python); on a real
cluster OUT must be a directory every executor and the driver reach (hdfs://, s3://, ... or a shared mount),
and `spark.stratkit.stagingDir` set (docs/spark.md). Run with --help for the options.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any


def build_model(units: int = 32, learning_rate: float = 0.01) -> Any:
    """The Keras model: called in every training process (import Keras inside)."""
    import keras

    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    return model


def session(app_name: str, master: str | None) -> Any:
    """A SparkSession whose executors run this interpreter (unless PYSPARK_PYTHON says otherwise)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    if os.environ.get("SPARK_LOCAL_IP"):  # the hostname may resolve to an interface executors cannot reach
        builder = builder.config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def load_table(spark: Any) -> Any:
    """The data as a DataFrame: id, ten feature columns, the label (what a real job reads from a table)."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    names = [name.replace(" ", "_") for name in data.feature_names]
    rows = [(i, *map(float, x), float(y)) for i, (x, y) in enumerate(zip(data.data * 10, data.target / 100))]
    return spark.createDataFrame(rows, ["id", *names, "label"]), names


def fit(spark: Any, out: str, args: argparse.Namespace) -> dict:
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from stratkit.spark import KerasEstimator

    df, names = load_table(spark)
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=names, outputCol="raw"),
        StandardScaler(inputCol="raw", outputCol="features", withMean=True),
        KerasEstimator(buildFn=build_model, featuresCols=["features"], labelCols=["label"], epochs=args.epochs,
                       batchSize=args.batch, numWorkers=args.workers, validation=0.2, seed=0),
    ])
    started = time.monotonic()
    model = pipeline.fit(df)
    seconds = time.monotonic() - started
    model.write().overwrite().save(f"{out}/pipeline")
    rmse, _ = _write_scores(spark, model.transform(df), f"{out}/fitted")
    history = model.stages[-1].history
    return {"fit_seconds": round(seconds, 1), "val_rmse": math.sqrt(history["val_loss"][-1]), "fit_rmse": rmse,
            "workers": model.stages[-1].training_info.get("workers")}


def score(spark: Any, out: str) -> dict:
    from pyspark.ml import PipelineModel

    df, _ = load_table(spark)
    started = time.monotonic()
    model = PipelineModel.load(f"{out}/pipeline")
    rmse, rows = _write_scores(spark, model.transform(df), f"{out}/scored")
    return {"score_seconds": round(time.monotonic() - started, 1), "rmse": rmse, "rows": rows}


def _write_scores(spark: Any, scored: Any, path: str) -> tuple[float, int]:
    """Write id, label, prediction as Parquet; the RMSE and the row count of what was written."""
    from pyspark.sql import functions as F

    scored.select("id", "label", "prediction").write.mode("overwrite").parquet(path)
    error = spark.read.parquet(path).agg(F.sqrt(F.avg((F.col("prediction") - F.col("label")) ** 2)),
                                         F.count("*")).first()
    return float(error[0]), int(error[1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", choices=("all", "fit", "score"), default="all")
    parser.add_argument("--out", required=True, help="directory for the pipeline and the scored table")
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[*])")
    parser.add_argument("--workers", type=int, default=2, help="training workers (default 2)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    args = parser.parse_args(argv)
    summary: dict = {}
    if args.step in ("all", "fit"):
        spark = session("stratkit-pipeline-fit", args.master)
        summary.update(fit(spark, args.out, args))
        spark.stop()
    if args.step in ("all", "score"):
        spark = session("stratkit-pipeline-score", args.master)
        summary.update(score(spark, args.out))
        spark.stop()
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
