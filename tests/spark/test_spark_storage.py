"""Spark and object stores (a real Spark, local-cluster[2,1,1024], and moto's S3 server on loopback).

`DataFrameInput(df, staging_dir="s3://...")`: the executors write the Parquet parts through the store layer
(no Hadoop S3 connector is installed here: Spark's own writer cannot reach s3://), the training tasks read
their shards from the store, and the run's staging is removed afterwards. A `train_fn` that saves with
`Trainer.save` to an s3:// URL and returns it works end to end. The executors get the store's settings the
way a cluster gives them (`sc.environment`, what `spark.executorEnv.*` fills); executors whose credentials
are refused stop the run with one `ConfigError` before any training.

The same session as tests/spark/test_spark_runner.py (shared_session: its executors start once).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import stores
from spark_helpers import shared_session

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.spark import DataFrameInput, SparkRunner, staging

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


@pytest.fixture(scope="module")
def s3(store_server, spark):
    """The S3 server, its settings in the driver and in the executors' environment."""
    server = store_server("s3")
    environment = spark.sparkContext.environment
    saved = dict(environment)
    environment.update(server.env)
    try:
        with stores.client_settings(server):
            yield server
    finally:
        environment.clear()
        environment.update(saved)


def _frame(spark, n):
    rows = [(i, [float(i), -float(i)], i % 3) for i in range(n)]
    return spark.createDataFrame(rows, "id long, vec array<float>, label int").repartition(3)


def test_the_executors_stage_a_dataframe_on_s3_and_every_row_is_read_back_once(spark, s3):
    url = s3.url(s3.make_bucket("staging-rows"), "stage")
    staged = staging.stage(DataFrameInput(_frame(spark, 101), feature_cols=["id", "vec"], staging_dir=url),
                           spark, "run-a", "data", num_shards=2)
    try:
        assert staged.num_rows == 101 and 1 <= len(staged.files) <= 3
        assert all(uri.startswith(url + "/run-a/data/part-") for uri, _ in staged.files)
        ids = [staged.shard(i, 2).to_numpy()[0][:, 0].astype(int).tolist() for i in range(2)]
        assert sorted(ids[0] + ids[1]) == list(range(101)) and {len(ids[0]), len(ids[1])} == {50, 51}
    finally:
        staging.remove(staged)
    assert storage.open_store(url + "/run-a/data").list() == []


def test_executors_whose_credentials_are_refused_stop_the_run_before_training(spark, s3):
    url = s3.url(s3.make_bucket("staging-refused"), "stage")
    environment = spark.sparkContext.environment
    environment["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"     # the executors' only (the driver's probe passes)
    try:
        with pytest.raises(ConfigError, match=r"the executors could not write the staged Parquet.*Fix: give every "
                                              r"executor this store's credentials") as caught:
            SparkRunner(num_workers=2).run(len, DataFrameInput(_frame(spark, 20), staging_dir=url))
    finally:
        environment["AWS_SECRET_ACCESS_KEY"] = s3.secret
    assert "not-the-secret" not in str(caught.value) and s3.secret not in str(caught.value)
    assert storage.open_store(url).list() == []


def train_and_save(data, out_url):
    """Trains on this worker's staged shard; saves to the store and returns the URL and the weights."""
    import stratkit

    trainer = stratkit.Trainer(seed=0)
    import keras

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = trainer.build(build)
    global_batch = 8 * trainer.num_replicas
    trainer.fit(model, data.dataset_fn(global_batch), steps_per_epoch=data.steps_per_epoch(global_batch),
                epochs=2, verbose=0)
    saved = trainer.save(model, out_url + "/model.keras")
    return {"saved": saved, "weights": [w.tolist() for w in model.get_weights()]}


def test_a_train_fn_on_s3_staged_data_saves_to_s3_and_the_driver_reads_it_back(spark, s3):
    import keras
    import numpy as np

    bucket = s3.make_bucket("spark-results")
    stage_url, out_url = s3.url(bucket, "stage"), s3.url(bucket, "out")
    result = SparkRunner(num_workers=2).run(train_and_save, DataFrameInput(_frame(spark, 64), staging_dir=stage_url),
                                            out_url)
    assert result["saved"] == out_url + "/model.keras"
    with storage.local_copy(result["saved"]) as path:
        loaded = keras.models.load_model(path)
    for got, want in zip(loaded.get_weights(), result["weights"]):
        assert np.array_equal(got, np.asarray(want, got.dtype))
    assert storage.open_store(stage_url).list() == []            # the run's staging went with the run


def test_a_run_staged_in_a_directory_on_disk_leaves_it_as_it_found_it(spark, tmp_path):
    """The run's copy goes, and so does its own `<run id>` directory (it left one empty directory a run)."""
    keep = tmp_path / "the-users-file.txt"
    keep.write_text("kept")
    shard = SparkRunner(num_workers=2).run(lambda data: data.num_rows, DataFrameInput(_frame(spark, 20),
                                                                                     staging_dir=str(tmp_path)))
    assert shard == 10                                               # the chief's half
    assert sorted(p.name for p in tmp_path.iterdir()) == ["the-users-file.txt"]
