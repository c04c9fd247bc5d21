"""Issue 50 on Spark: a table is read in place by every executor, never staged (a real 2-executor Spark).

* a `stratkit.data.TableInput` argument of `SparkRunner.run`: 2 executors train as one process reading the same
  table (weights and history within 1e-5), every row id once per epoch over the two, no staging directory;
* a DataFrame that is `spark.read.parquet(dir).select(...)`, passed as a `DataFrameInput`: read in place the same
  way (train_fn receives the `TableInput` of its path and columns), equal to the same one process;
* `KerasEstimator.fit(spark.read.parquet(dir))` reads it in place too, and trains as the same one process;
* a table that cannot be planned is a `ConfigError` on the driver, before any Spark job;
* which DataFrames are read in place (`stratkit.spark.in_place`): a scan and a select of columns are; a filter, a
  computed column, a cast, a repartition, a DataFrame made in memory, `in_place=False` are staged, and
  `in_place=True` on one of those is a `ConfigError` saying why.

The table is small (16 files of unequal sizes, 1500 rows, row groups of several sizes): what is checked is
where the rows come from, not the reader's speed (benchmarks/bench_spark_lake.py measures in place vs staged).
The session is tests/spark/test_spark_runner.py's (`shared_session`).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from spark_helpers import shared_session

from procs import describe, run_process
from stratkit.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
import lake_tables  # noqa: E402
import lake_train  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(lake_train)

FILES, ROWS = 16, 1500       # lake_train's default batch 256: 6 steps an epoch, the last one 220 rows; 2 epochs


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    import pyarrow.fs as pafs

    root = tmp_path_factory.mktemp("lake") / "t16"
    root.mkdir()
    assert lake_tables.write_parquet(pafs.LocalFileSystem(), str(root), FILES, ROWS) == ROWS
    return str(root)


@pytest.fixture(scope="module")
def reference(table_dir):
    one = run_process(str(DATA / "lake_train.py"), args=[table_dir], timeout=300)
    assert one.ok, describe([one])
    (line,) = [s for s in one.stdout.splitlines() if s.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    for epoch in ("0", "1"):
        assert sorted(result["ids"][epoch]) == list(range(ROWS))
    return result


def train_and_keep(data, out_dir):
    """lake_train.train on what the runner handed over; each worker's result kept in `out_dir` (the executors
    of a local-cluster share this machine's disk), with what it received."""
    import os

    result = lake_train.train(data)
    result["received"] = [type(data).__name__, list(getattr(data, "features", [])), getattr(data, "label", None)]
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as out:
        json.dump(result, out)
    return result["rank"]


@pytest.fixture
def no_staging(monkeypatch, tmp_path):
    """Staging through a spy that counts (and still stages), and the driver's temp dir an empty one of the test's:
    a staged argument on this local master makes its staging directory there."""
    from stratkit.spark import staging

    calls = []
    real = staging.stage

    def spy(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    scratch = tmp_path / "driver-tmp"
    scratch.mkdir()
    monkeypatch.setattr(staging, "stage", spy)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield calls, scratch


def _same(a, b):
    gap = max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a["w"], b["w"]))
    assert gap <= 1e-5, gap
    for key in a["h"]:
        np.testing.assert_allclose(a["h"][key], b["h"][key], atol=1e-5, err_msg=key)


def _results(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))}


def _check_run(out_dir, reference, received):
    results = _results(out_dir)
    assert set(results) == {0, 1}
    for rank, result in results.items():
        assert result["received"] == received, rank
        _same(reference, result)
    for w0, w1 in zip(results[0]["w"], results[1]["w"]):      # one model on both executors, bit for bit
        assert np.array_equal(w0, w1), float(np.max(np.abs(np.subtract(w0, w1))))
    for epoch in ("0", "1"):
        ids = results[0]["ids"][epoch] + results[1]["ids"][epoch]
        assert len(ids) == ROWS and sorted(ids) == list(range(ROWS)), epoch   # each row once, none padded
        assert min(len(r["ids"][epoch]) for r in results.values()) > ROWS // 3   # both workers read


def test_a_table_input_is_read_in_place_by_two_executors_as_one_process_reads_it(spark, table_dir, reference,
                                                                                no_staging, tmp_path):
    from stratkit.spark import SparkRunner
    from stratkit.data import Table, TableInput

    calls, scratch = no_staging
    out = tmp_path / "out"
    out.mkdir()
    data = TableInput(Table.parquet(table_dir), features=["x", "id"], label="y", seed=11, lanes=12)
    assert SparkRunner(num_workers=2, spark=spark, timeout=600).run(train_and_keep, data, str(out)) == 0
    _check_run(out, reference, ["TableInput", ["x", "id"], "y"])
    assert calls == [] and list(scratch.iterdir()) == []          # nothing staged, no staging directory


def test_a_dataframe_scanning_a_parquet_table_is_read_in_place_not_staged(spark, table_dir, reference, no_staging,
                                                                         tmp_path):
    from stratkit.spark import SparkRunner
    from stratkit.spark import DataFrameInput

    calls, scratch = no_staging
    out = tmp_path / "out"
    out.mkdir()
    frame = spark.read.parquet(table_dir).select("y", "x", "id")
    data = DataFrameInput(frame, feature_cols=["x", "id"], label_col="y", in_place=None)
    assert SparkRunner(num_workers=2, spark=spark, timeout=600).run(train_and_keep, data=data, out_dir=str(out)) == 0
    _check_run(out, reference, ["ScannedTable", ["x", "id"], "y"])   # a TableInput (lake_train reads its table)
    assert calls == [] and list(scratch.iterdir()) == []


def train_staged_and_keep(data, out_dir):
    """A staged DataFrame's shard, trained as the table it was staged into (`ParquetShard.table_input`); worker 0
    first copies the staged files to `out_dir/staged` (one process then reads the same table)."""
    import os
    import shutil

    table = data.table_input()
    if data.index == 0:
        os.makedirs(os.path.join(out_dir, "staged"))
        for path in table.plan().files:
            shutil.copy(path, os.path.join(out_dir, "staged"))
    return train_and_keep(table, out_dir)


def test_a_staged_dataframe_trains_through_the_table_reader_on_two_executors_as_one_process_reads_the_copy(
        spark, table_dir, no_staging, tmp_path):
    """A DataFrame Spark computes is staged; `data.table_input()` reads the staged copy with the table reader:
    each row once per epoch (the last batch partial, none skipped), the 2 executors equal to one process reading
    the same files."""
    from stratkit.spark import DataFrameInput, SparkRunner

    calls, _ = no_staging
    out = tmp_path / "out"
    out.mkdir()
    frame = spark.read.parquet(table_dir).filter("id >= 0")            # computed: staged
    data = DataFrameInput(frame, feature_cols=["x", "id"], label_col="y", in_place=None)
    runner = SparkRunner(num_workers=2, spark=spark, timeout=600)
    assert runner.run(train_staged_and_keep, data=data, out_dir=str(out)) == 0
    assert calls == ["data"]
    one = run_process(str(DATA / "lake_train.py"), args=[str(out / "staged")], timeout=300)
    assert one.ok, describe([one])
    (line,) = [s for s in one.stdout.splitlines() if s.startswith("RESULT ")]
    _check_run(out, json.loads(line[len("RESULT "):]), ["TableInput", ["x", "id"], "y"])


def test_only_a_plain_parquet_scan_is_read_in_place(spark, table_dir, tmp_path):
    from pyspark.sql import functions as F

    from stratkit.spark import DataFrameInput
    from stratkit.spark.in_place import read_in_place

    scan = spark.read.parquet(table_dir)
    columns = {"feature_cols": ["x", "id"], "label_col": "y"}
    kept = read_in_place(DataFrameInput(scan, in_place=None, **columns), spark, "data")
    assert kept is not None and kept.table.columns == ["x", "id", "y"] and kept.num_rows == ROWS
    assert kept.steps_per_epoch(256, 2) == kept.steps_per_epoch(256) == 6    # a ParquetShard's call works on it
    with pytest.raises(ConfigError, match="to_numpy.*in_place=False"):
        kept.to_numpy()
    selected = DataFrameInput(scan.select("id", "x", "y"), in_place=None, **columns)
    assert read_in_place(selected, spark, "data") is not None
    computed = {
        "filter": scan.filter("id > 10"),
        "computed column": scan.select("x", "y", (F.col("id") + 1).alias("id")),
        "cast": scan.select("x", "y", F.col("id").cast("int").alias("id")),
        "repartition": scan.repartition(3),
        "limit": scan.limit(100),
        "in memory": spark.createDataFrame([(0, [0.0, 1.0, 2.0], 1.0)], "id long, x array<float>, y float"),
    }
    for what, frame in computed.items():
        assert read_in_place(DataFrameInput(frame, in_place=None, **columns), spark, "data") is None, what
    assert read_in_place(DataFrameInput(scan, in_place=False, **columns), spark, "data") is None
    assert read_in_place(DataFrameInput(scan, **columns), spark, "data") is None    # the default stages
    other = tmp_path / "part"   # a file Spark reads but stratkit skips: the listings differ, so staged
    other.mkdir()
    (other / "a.parquet").write_bytes((Path(table_dir) / "part-00000.parquet").read_bytes())
    (other / "b.data").write_bytes((Path(table_dir) / "part-00001.parquet").read_bytes())
    listed_apart = DataFrameInput(spark.read.parquet(str(other)), in_place=None, **columns)
    assert read_in_place(listed_apart, spark, "data") is None
    with pytest.raises(ConfigError, match="in_place=True.*not a plain scan.*Filter"):
        read_in_place(DataFrameInput(computed["filter"], in_place=True, **columns), spark, "data")


def build_model():
    """lake_train's model without its id recording: the same weights from the same seed."""
    import keras

    keras.utils.set_random_seed(5)
    x = keras.Input((3,), name="x")
    ids = keras.Input((), dtype="int64", name="id")
    hidden = keras.layers.Dense(8, activation="tanh")(x)
    zero = keras.layers.Lambda(lambda t: 0.0 * keras.ops.cast(keras.ops.expand_dims(t, -1) % 2, "float32"),
                               output_shape=(1,))(ids)     # (the shape lets the saved model load)
    out = keras.layers.Dense(1)(keras.layers.Add()([hidden, zero * hidden]))
    model = keras.Model([x, ids], out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def test_keras_estimator_reads_a_parquet_scan_in_place_and_trains_as_one_process(spark, table_dir, reference,
                                                                                 no_staging, caplog):
    from stratkit.spark import KerasEstimator

    calls, scratch = no_staging
    estimator = KerasEstimator(buildFn=build_model, featuresCols=["x", "id"], labelCols=["y"], batchSize=256,
                               epochs=2, numWorkers=2, seed=11, verbose=0, timeout=600.0)
    fitted = estimator.fit(spark.read.parquet(table_dir))
    assert calls == [] and list(scratch.iterdir()) == []
    # said in the estimator's words (it named "argument 'arg1'" and DataFrameInput(df, in_place=False))
    said = caplog.text
    assert re.search(r"the DataFrame passed to fit\(\) is a scan of the Parquet table .*readInPlace=False stages "
                     r"it", said), said
    assert "arg1" not in said and "DataFrameInput" not in said
    _same({"w": reference["w"], "h": {k: reference["h"][k] for k in ("loss", "mae")}},
          {"w": [w.tolist() for w in fitted.keras_model().get_weights()], "h": fitted.history})


def test_a_table_that_cannot_be_planned_is_refused_on_the_driver_before_any_job(spark, tmp_path):
    from stratkit.data import Table, TableInput
    from stratkit.spark import SparkRunner

    runner = SparkRunner(num_workers=2, spark=spark)
    missing = TableInput(Table.parquet(str(tmp_path / "nothing-here")), features=["x"], label="y")
    with pytest.raises(ConfigError, match="nothing-here"):
        runner.run(train_and_keep, missing, str(tmp_path))
    assert runner.last_run.attempts == 0          # no barrier stage was submitted
