"""Spark: the same Parquet table trained read in place vs staged, through `SparkRunner` on 2 executors.

One SparkSession (master local-cluster[2,1,2048]: 2 executors of 1 core) and one Parquet table on local disk
(FULL: 400,000 rows in 24 files, a 16-float feature column `x`, an int64 `id`, a float32 label `y`; ~35 MB).
The same train_fn (a 16-64-1 MLP, `stratkit.Trainer`, global batch 2048, 1 epoch) runs on
`DataFrameInput(spark.read.parquet(table), feature_cols=["x"], label_col="y")` two ways:

  * in place (`in_place=None`, the default): the DataFrame is a plain scan, so `stratkit.spark.in_place` plans
    the table on the driver and each worker's `Trainer.fit` reads its lanes of the files (`stratkit.data`);
  * staged (`in_place=False`): the executors copy the columns into a staging directory first
    (`stratkit.spark.staging`), and each worker reads its `ParquetShard` of the copy.

A warm-up run of each way (not counted, kept in the JSON as `warm_up`) starts the executors' Python workers, the
standby and the staging job's Arrow workers (the first staging job on fresh executors costs a minute more). Then
`rounds`
alternating rounds (in place then staged, then staged then in place, ...), each way once per round; the load
average before and after each run is recorded. Per run: wall (run() called to returned), "before the stage"
(run() called to the barrier stage submitted: the driver's planning, or the staging job), and the chief's
training time (its first step to the end of training), from `RunReport.timeline`. The table gives mean and
spread (sample standard deviation); the ratio is staged wall / in-place wall.

    python benchmarks/bench_spark_lake.py [--quick]    # results/spark-lake.json (-quick.json)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FULL = {"rows": 400_000, "files": 24, "width": 16, "batch": 2048, "epochs": 1, "rounds": 3}
QUICK = {"rows": 20_000, "files": 4, "width": 16, "batch": 512, "epochs": 1, "rounds": 1}
MASTER = "local-cluster[2,1,2048]"
WAYS = ("in place", "staged")


def write_table(root: Path, rows: int, files: int, width: int) -> int:
    """`files` Parquet files of unequal sizes under `root`; the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    weights = rng.uniform(1.0, 3.0, files)
    counts = np.floor(weights / weights.sum() * rows).astype(int)
    counts[: rows - counts.sum()] += 1
    at = 0
    w = rng.normal(size=width).astype("float32")
    for index, count in enumerate(counts):
        x = rng.normal(size=(count, width)).astype("float32")
        y = (x @ w + 0.1 * rng.normal(size=count)).astype("float32")
        table = pa.table({"id": pa.array(np.arange(at, at + count, dtype=np.int64)),
                          "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width), "y": pa.array(y)})
        pq.write_table(table, root / f"part-{index:05d}.parquet", row_group_size=8192)
        at += count
    return sum(p.stat().st_size for p in root.glob("*.parquet"))


def train(data, batch: int, epochs: int) -> dict:
    """The same model on a TableInput (read in place) or a ParquetShard (staged); the chief's history."""
    import stratkit

    trainer = stratkit.Trainer()
    import keras

    from stratkit.data import TableInput

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((int(os.environ.get("BENCH_WIDTH", "16")),), name="x")
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        return model

    model = trainer.build(build)
    if isinstance(data, TableInput):
        kind = "in place"
        history = trainer.fit(model, data, epochs=epochs, global_batch_size=batch, verbose=0)
    else:
        kind = "staged"
        history = trainer.fit(model, data.dataset_fn(batch, model=model), epochs=epochs, verbose=0,
                              steps_per_epoch=data.steps_per_epoch(batch, trainer.num_replicas))
    return {"kind": kind, "loss": [float(v) for v in history.history["loss"]]}


def _event(report, who_prefix: str, event: str) -> float | None:
    for entry in report.timeline:
        if entry["who"].startswith(who_prefix) and entry["event"].startswith(event):
            return entry["t"]
    return None


def one_run(spark, runner, table: str, way: str, size: dict) -> dict:
    from stratkit.spark import DataFrameInput

    frame = spark.read.parquet(table)
    data = DataFrameInput(frame, feature_cols=["x"], label_col="y", in_place=None if way == "in place" else False)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    result = runner.run(train, data, size["batch"], size["epochs"])
    wall = time.monotonic() - started
    report = runner.last_run
    called = report.called_at
    submitted = _event(report, "driver", "stage submitted")
    first = _event(report, "worker:0", "first step begins")
    done = _event(report, "worker:0", "training ends")
    assert result["kind"] == way, (result, way)
    return {"way": way, "wall_s": wall, "before_stage_s": (submitted - called) if submitted else None,
            "training_s": (done - first) if first and done else None, "loss": result["loss"][-1],
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def _summary(runs: list[dict], key: str) -> tuple[float | None, float | None]:
    values = [r[key] for r in runs if r[key] is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["BENCH_WIDTH"] = str(size["width"])
    from pyspark.sql import SparkSession

    from stratkit.spark import SparkRunner

    scratch = Path(tempfile.mkdtemp(prefix="stratkit-bench-spark-lake-"))
    table = scratch / "table"
    table.mkdir()
    table_bytes = write_table(table, size["rows"], size["files"], size["width"])
    session_started = time.monotonic()
    spark = (SparkSession.builder.master(MASTER).appName("stratkit-bench-spark-lake")
             .config("spark.driver.host", "127.0.0.1").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.executor.memory", "1g")
             .config("spark.executorEnv.PYTHONPATH", str(ROOT))
             .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "3")
             .config("spark.executorEnv.BENCH_WIDTH", str(size["width"])).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    session_s = time.monotonic() - session_started
    runs: list[dict] = []
    try:
        runner = SparkRunner(num_workers=2, spark=spark, timeout=1800)
        # Not counted: the executors' Python workers and standby start, and the staging job's first Arrow workers
        # (measured 82 s on fresh executors at load 16: a cost of the first staged run only).
        warm = [one_run(spark, runner, str(table), way, size) for way in WAYS]
        for index in range(size["rounds"]):
            for way in (WAYS if index % 2 == 0 else WAYS[::-1]):
                run = one_run(spark, runner, str(table), way, size)
                run["round"] = index
                runs.append(run)
                print(f"round {index} {way}: wall {run['wall_s']:.1f}s, before the stage "
                      f"{run['before_stage_s']:.1f}s, training {run['training_s']:.1f}s, load "
                      f"{run['load_before']:.1f}->{run['load_after']:.1f}", flush=True)
    finally:
        spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for way in WAYS:
        mine = [r for r in runs if r["way"] == way]
        wall, wall_sd = _summary(mine, "wall_s")
        before, before_sd = _summary(mine, "before_stage_s")
        training, training_sd = _summary(mine, "training_s")
        rows.append({"way": way, "wall s": wall, "wall sd": wall_sd, "before stage s": before,
                     "before sd": before_sd, "training s": training, "training sd": training_sd})
    ratio = rows[1]["wall s"] / rows[0]["wall s"]
    print_table(f"{size['rows']:,} rows, {table_bytes / 1e6:.1f} MB Parquet, 2 executors "
                f"(staged / in place wall: {ratio:.2f}x)", rows)
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    name = "spark-lake-quick" if args.quick else "spark-lake"
    path = write_result(name, {"quick": args.quick, "size": size, "master": MASTER, "table_bytes": table_bytes,
                               "session_s": session_s, "warm_up": warm, "rows": rows, "runs": runs,
                               "ratio_staged_over_in_place": ratio, "load_range": [min(loads), max(loads)]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
