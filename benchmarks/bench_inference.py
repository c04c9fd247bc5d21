"""Batch inference on Spark executors: stratkit's `keras_predict` against a hand-written pandas UDF, same data.

One SparkSession (local-cluster[2,1,2048]: 2 executors of 1 core, separate JVMs as on a cluster; local[2]
with --quick) scores one cached DataFrame of 1,000,000 rows (a 32-float array column, 8 partitions) with
one Keras model (32 -> 64 -> 64 -> 1, ReLU) five ways, written to Spark's `noop` sink so every row is
scored and nothing is collected:

  * stratkit: `stratkit.spark.keras_predict(df, "model.keras", ["features"])` -- an Arrow iterator UDF,
    the model loaded once per Python worker, batches of 1024 rows, TensorFlow's threads = spark.task.cpus;
  * the same through its pandas iterator UDF (what pyspark before 4.1, without `arrow_udf`, runs);
  * pandas UDF: the usual recipe, an iterator `@pandas_udf` that loads the model once per task and calls
    `model.predict(np.vstack(series), batch_size=1024)` on each Arrow batch (TensorFlow's default threads);
  * predict_batch_udf: pyspark's own (`pyspark.ml.functions.predict_batch_udf`, 3.4+), batch 1024, the
    model loaded once per Python worker by its cache;
  * an Arrow iterator UDF that returns zeros without any model: the ceiling of a Python UDF over these
    rows on this cluster (Spark's Arrow transfer both ways and the Python worker, nothing else).

Right before each measured run, the same way scores 20,000 other rows (4 partitions, not measured): Spark
replaces idle Python workers (its worker factory stops them after a minute without work), and a new worker
imports TensorFlow and loads the model (about 5-30 s here, by load) in whichever run meets it first; the
warm-up puts that cost outside every measured run alike, so the rows/s are the steady state. `rounds`
alternating rounds (the order of the ways rotates each round), each scoring all the rows once per way:
rows/s per run, mean and sample standard deviation over rounds, with the load average before and after
every run. Every way's predictions are compared with one process's `model.predict` on 1,000 rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from jobs import REPO  # noqa: E402

sys.path.insert(0, str(REPO))  # the driver imports this checkout's stratkit, as its executors do (executorEnv)

LOCAL_CLUSTER = "local-cluster[2,1,2048]"
FULL = {"rows": 1_000_000, "partitions": 8, "rounds": 3, "warmup_rows": 20_000, "master": LOCAL_CLUSTER}
QUICK = {"rows": 20_000, "partitions": 4, "rounds": 1, "warmup_rows": 2_000, "master": "local[2]"}
WIDTH = 32
BATCH = 1024
WAYS = ("stratkit keras_predict", "stratkit, pandas UDF path (pyspark < 4.1)", "pandas UDF (usual recipe)",
        "pyspark predict_batch_udf", "Arrow UDF returning zeros (no model)")
BASELINE = WAYS[2]


def build_model(path: str) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.save(path)


def session(master: str):
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("stratkit-bench-inference")
    confs = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1", "spark.ui.enabled": "false",
             "spark.ui.showConsoleProgress": "false", "spark.executor.memory": "1500m",
             "spark.pyspark.python": sys.executable, "spark.sql.shuffle.partitions": "8",
             # the executors import this checkout's stratkit; quiet TensorFlow; no GPU
             "spark.executorEnv.PYTHONPATH": str(REPO), "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "3",
             "spark.executorEnv.CUDA_VISIBLE_DEVICES": ""}
    for key, value in confs.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def table(spark, rows: int, partitions: int):
    """id and a 32-float array column, generated on the executors, cached and counted."""
    from pyspark.sql import functions as F

    features = F.array(*[F.rand(seed=i).cast("float") for i in range(WIDTH)]).alias("features")
    frame = spark.range(0, rows, 1, partitions).select("id", features).cache()
    assert frame.count() == rows
    return frame


def pandas_recipe(path: str):
    """The hand-written pandas UDF most users write."""
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("double")
    def predict(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        import keras

        model = keras.saving.load_model(path)
        for series in batches:
            x = np.vstack(series.to_numpy()).astype("float32")
            yield pd.Series(model.predict(x, batch_size=BATCH, verbose=0)[:, 0].astype("float64"))

    return predict


def batch_udf(path: str):
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import DoubleType

    def make_predict_fn():
        import keras

        model = keras.saving.load_model(path)

        def predict(inputs: np.ndarray) -> np.ndarray:
            return model.predict(inputs, batch_size=BATCH, verbose=0)[:, 0].astype("float64")

        return predict

    return predict_batch_udf(make_predict_fn, return_type=DoubleType(), batch_size=BATCH,
                             input_tensor_shapes=[[WIDTH]])


_udfs: dict = {}


def zeros():
    from pyspark.sql import functions as F

    def run(batches):
        import pyarrow as pa

        for batch in batches:
            yield pa.nulls(len(batch), pa.float64()).fill_null(0.0)

    import warnings

    with warnings.catch_warnings():  # the UDF type given, not read from type hints
        warnings.simplefilter("ignore")
        return F.arrow_udf(run, "double", F.ArrowUDFType.SCALAR_ITER)


def scored(way: str, frame, path: str):
    """`frame` with the way's "prediction" column (each way's UDF made once, as a user makes it)."""
    from pyspark.sql import functions as F

    if way in WAYS[:2]:
        from stratkit.spark import keras_predict
        from stratkit.spark.ml import inference

        inference.PREFER_ARROW = way == WAYS[0]
        try:
            return keras_predict(frame, path, ["features"], batch_size=BATCH)
        finally:
            inference.PREFER_ARROW = True
    if way not in _udfs:
        _udfs[way] = {WAYS[2]: pandas_recipe, WAYS[3]: batch_udf, WAYS[4]: lambda _: zeros()}[way](path)
    return frame.withColumn("prediction", _udfs[way](F.col("features")))


def score_all(way: str, frame, path: str) -> None:
    """Score every row (the noop sink computes each row's prediction and keeps nothing)."""
    scored(way, frame, path).select("id", "prediction").write.format("noop").mode("overwrite").save()


def run(way: str, frame, path: str, rows: int, warm=None) -> dict:
    if warm is not None:
        score_all(way, warm, path)
    before = os.getloadavg()
    started = time.monotonic()
    score_all(way, frame, path)
    seconds = time.monotonic() - started
    return {"way": way, "seconds": seconds, "rows_per_second": rows / seconds, "load_before": before,
            "load_after": os.getloadavg()}


def check(way: str, frame, path: str) -> float:
    """The largest difference from one process's model.predict on the first 1,000 rows."""
    import keras

    rows = scored(way, frame.orderBy("id").limit(1000), path).orderBy("id").collect()
    x = np.array([row["features"] for row in rows], "float32")
    expected = keras.saving.load_model(path).predict(x, verbose=0)[:, 0]
    return float(np.abs(np.array([row["prediction"] for row in rows]) - expected).max())


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for way in WAYS:
        rates = [r["rows_per_second"] for r in runs if r["way"] == way]
        rows.append({"way": way, "rows/s": statistics.mean(rates),
                     "spread": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                     "min rows/s": min(rates), "max rows/s": max(rates), "runs": len(rates)})
    base = next(row["rows/s"] for row in rows if row["way"] == BASELINE)
    for row in rows:
        row["vs pandas UDF"] = row["rows/s"] / base
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--master", default=None)
    args = parser.parse_args(argv)
    job = dict(QUICK if args.quick else FULL)
    for key in ("rounds", "rows", "master"):
        if getattr(args, key):
            job[key] = getattr(args, key)
    started = time.monotonic()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-inference-") as tmp:
        path = os.path.join(tmp, "model.keras")
        build_model(path)
        spark = session(job["master"])
        try:
            frame = table(spark, job["rows"], job["partitions"])
            warm = table(spark, job["warmup_rows"], job["partitions"])  # every executor's Python worker
            errors = {}
            for way in WAYS[:-1]:  # the last way has no model
                errors[way] = check(way, frame, path)
            runs = []
            for round_index in range(job["rounds"]):
                order = list(WAYS[round_index % len(WAYS):] + WAYS[:round_index % len(WAYS)])
                for way in order:
                    result = run(way, frame, path, job["rows"], warm)
                    result["round"] = round_index
                    runs.append(result)
                    print(f"round {round_index}: {way}: {result['rows_per_second']:,.0f} rows/s "
                          f"({result['seconds']:.1f} s, load {result['load_before'][0]:.1f})", flush=True)
        finally:
            spark.stop()
    rows = summarize(runs)
    for row in rows:
        row["max |diff| vs model.predict"] = errors.get(row["way"])
    print_table(f"{job['rows']:,} rows, {job['partitions']} partitions, {job['master']}: rows per second "
                f"(mean over {job['rounds']} round(s))", rows)
    payload = {"quick": args.quick, "job": {**job, "width": WIDTH, "batch": BATCH,
                                            "model": f"MLP {WIDTH}-64-64-1"},
               "rows": rows, "runs": runs, "loadavg_before": load_start, "loadavg_after": os.getloadavg(),
               "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('inference' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
