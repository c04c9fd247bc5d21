"""KerasEstimator / KerasModel / keras_predict on a real 2-executor Spark (local-cluster[2,1,1024]).

The session is tests/spark/test_spark_runner.py's (same master and confs: `shared_session`), so the
executors start once for both. One Pipeline is fitted per module (a module fixture) and every test that only
scores or saves reuses it; the reference is one process's `model.predict` on the same rows.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import ml_models
import numpy as np
import pytest
from spark_helpers import shared_session

from stratkit.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(ml_models)

ROWS = 96


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


def _rows(n: int = ROWS, seed: int = 0) -> list[tuple]:
    """id, three features on very different scales (what the StandardScaler is for), a linear label."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)) * [1.0, 10.0, 100.0] + [0.0, 5.0, 50.0]
    y = x @ [1.0, 0.1, 0.01]
    return [(i, float(a), float(b), float(c), float(t)) for i, ((a, b, c), t) in enumerate(zip(x, y))]


SCHEMA = "id long, a double, b double, c double, label double"


def _pipeline(**estimator):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from stratkit.spark import KerasEstimator

    params = {"buildFn": ml_models.build_regressor, "labelCols": ["label"], "epochs": 2, "batchSize": 32,
              "seed": 3, **estimator}
    return Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"], outputCol="raw"),
                            StandardScaler(inputCol="raw", outputCol="features", withMean=True),
                            KerasEstimator(**params)])


@pytest.fixture(scope="module")
def fitted(spark):
    """(the DataFrame, the fitted PipelineModel, its predictions by id, the seconds fit took)."""
    df = spark.createDataFrame(_rows(), SCHEMA).repartition(3)
    started = time.monotonic()
    model = _pipeline(validation=0.25).fit(df)
    seconds = time.monotonic() - started
    scored = model.transform(df).select("id", "features", "prediction").collect()
    return df, model, scored, seconds


def _no_job_runs(spark):
    """A context that fails when the block ran a Spark job."""
    tracker = spark.sparkContext.statusTracker()

    class Watch:
        def __enter__(self):
            self.before = set(tracker.getJobIdsForGroup(None))
            return self

        def __exit__(self, *exc):
            ran = set(tracker.getJobIdsForGroup(None)) - self.before
            assert not ran, f"Spark jobs {sorted(ran)} ran before the error"
            return False

    return Watch()


# -- the pipeline ---------------------------------------------------------------------------------

def test_a_pipeline_trains_on_two_workers_and_scores_as_one_process_predicts(fitted, capsys):
    _, model, scored, seconds = fitted
    keras_stage = model.stages[-1]
    assert keras_stage.training_info["workers"] == 2
    assert len(keras_stage.history["loss"]) == 2 and len(keras_stage.history["val_loss"]) == 2
    assert keras_stage.history["loss"][1] < keras_stage.history["loss"][0]
    features = np.array([row["features"].toArray() for row in scored], "float32")
    expected = keras_stage.keras_model().predict(features, verbose=0)[:, 0]
    got = np.array([row["prediction"] for row in scored])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    print(f"fit of the 3-stage pipeline on 2 workers: {seconds:.1f} s")


def test_the_saved_pipeline_loads_and_scores_the_same(spark, fitted, tmp_path):
    from pyspark.ml import PipelineModel

    df, model, scored, _ = fitted
    model.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    again = dict(loaded.transform(df).select("id", "prediction").collect())
    assert [type(stage).__name__ for stage in loaded.stages] == ["VectorAssembler", "StandardScalerModel",
                                                                 "KerasModel"]
    assert loaded.stages[-1].history == model.stages[-1].history
    for row in scored:
        assert again[row["id"]] == row["prediction"]
    # the stage directory holds a plain .keras file
    import keras

    stage_dir = next((tmp_path / "pipeline" / "stages").glob("2_KerasModel_*"))
    assert isinstance(keras.saving.load_model(stage_dir / "model.keras"), keras.Model)


def test_an_unfitted_pipeline_saves_and_loads_with_its_build_function(spark, tmp_path):
    from pyspark.ml import Pipeline

    from stratkit.spark import KerasEstimator

    pipeline = _pipeline(buildParams={"units": 5}, callbacks=[], epochs=4, validation="is_val")
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    estimator = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert isinstance(estimator, KerasEstimator)
    assert (estimator.getEpochs(), estimator.getBuildParams(), estimator.getValidation()) == (4, {"units": 5}, "is_val")
    assert estimator.getCallbacks() == [] and estimator.uid == pipeline.getStages()[-1].uid
    assert estimator.getBuildFn()(units=5).layers[0].units == 5  # the build function came back, pickled by value
    with pytest.raises(Exception, match="already exists"):  # Spark ML's rule: no silent overwrite
        pipeline.getStages()[-1].save(str(tmp_path / "pipeline" / "stages" / f"2_{estimator.uid}"))


def test_a_train_validation_split_tunes_the_build_params_one_training_per_trial(spark, caplog):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    df = spark.createDataFrame(_rows(), SCHEMA)
    pipeline = _pipeline(epochs=1)
    estimator = pipeline.getStages()[-1]
    grid = ParamGridBuilder().addGrid(estimator.buildParams, [{"units": 2}, {"units": 16}]).build()
    tuning = TrainValidationSplit(estimator=pipeline, estimatorParamMaps=grid, trainRatio=0.75, seed=1,
                                  evaluator=RegressionEvaluator(labelCol="label", predictionCol="prediction"))
    started = time.monotonic()
    with caplog.at_level("INFO", logger="stratkit.spark.runner"):
        tuned = tuning.fit(df)
    seconds = time.monotonic() - started
    assert len(tuned.validationMetrics) == 2 and all(np.isfinite(tuned.validationMetrics))
    best = tuned.bestModel.stages[-1]
    assert best.getOrDefault("buildParams") == grid[int(np.argmin(tuned.validationMetrics))][estimator.buildParams]
    runs = [r for r in caplog.records if "attempt 1, 2 barrier task(s)" in r.getMessage()]
    assert len(runs) == 3  # one training per trial, then the best one on all the rows
    assert len(tuned.transform(df).select("prediction").collect()) == ROWS
    print(f"TrainValidationSplit, 2 trials + the refit: {seconds:.1f} s ({seconds / 3:.1f} s per training)")


# -- scoring any saved model ----------------------------------------------------------------------

def _two_input_frame(spark, n: int = 60):
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(1)
    pixels = rng.normal(size=(n, 4)).astype("float32")
    extra = rng.normal(size=(n, 3))
    frame = spark.createDataFrame([(i, [float(v) for v in pixels[i]], *map(float, extra[i])) for i in range(n)],
                                  "id long, pixels array<float>, e0 double, e1 double, e2 double").repartition(3)
    return VectorAssembler(inputCols=["e0", "e1", "e2"], outputCol="extra").transform(frame), pixels, extra


def test_keras_predict_feeds_several_inputs_gives_each_head_a_column_and_loads_once_per_worker(spark, tmp_path,
                                                                                             monkeypatch):
    from stratkit.spark import keras_predict
    from stratkit.spark.ml import inference

    log = tmp_path / "loads.jsonl"
    model = ml_models.two_inputs_two_heads(str(log))
    path = tmp_path / "model.keras"
    model.save(path)
    frame, pixels, extra = _two_input_frame(spark)
    expected_price, expected_kind = model.predict([pixels.reshape(-1, 2, 2), extra.astype("float32")], verbose=0)
    custom = {"Probe": ml_models.probe_class()}
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")  # model batches of 5 span Arrow batches
    try:
        runs = {}
        for arrow in (True, False):  # the Arrow UDF, and the pandas UDF older pyspark gets
            monkeypatch.setattr(inference, "PREFER_ARROW", arrow)
            scored = keras_predict(frame, str(path), ["pixels", "extra"], batch_size=5, custom_objects=custom)
            assert dict(scored.dtypes)["prediction_price"] == "double"
            assert dict(scored.dtypes)["prediction_kind"] == "array<float>"
            runs[arrow] = sorted(scored.select("id", "prediction_price", "prediction_kind").collect())
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    for rows in runs.values():
        np.testing.assert_allclose([r["prediction_price"] for r in rows], expected_price[:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose([r["prediction_kind"] for r in rows], expected_kind, atol=1e-5, rtol=0)
    loads = [json.loads(line) for line in log.read_text().splitlines()]
    workers = [load["pid"] for load in loads if load["pid"] != os.getpid()]  # the driver described it once
    assert workers and len(workers) == len(set(workers)), f"a Python worker loaded the model twice: {loads}"
    assert len(workers) < 6, f"the model was loaded per task (2 jobs x 3 partitions), not per worker: {loads}"
    # useGpu=False hides GPUs from TensorFlow, which started before the model loaded (with the GPUs hidden)
    assert all(load["visible"] == "" and load["started"] for load in loads if load["pid"] != os.getpid()), loads


def test_class_predictions_are_spark_mls_classifier_columns_for_its_evaluators(spark, fitted, tmp_path):
    import keras
    from pyspark.ml import PipelineModel
    from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
    from pyspark.sql import functions as F

    from stratkit.spark import keras_predict

    df, model, _, _ = fitted
    scaled = PipelineModel(stages=model.stages[:2]).transform(df).withColumn("label", (F.col("a") > 0).cast("int"))
    features = np.array([row["features"].toArray() for row in sorted(scaled.collect())], "float32")
    for heads, activation in ((3, "softmax"), (1, "sigmoid")):
        keras.utils.set_random_seed(heads)
        classifier = keras.Sequential([keras.Input((3,)), keras.layers.Dense(heads, activation=activation)])
        classifier.save(tmp_path / f"{activation}.keras")
        scored = keras_predict(scaled, str(tmp_path / f"{activation}.keras"), ["features"], prediction_kind="class")
        assert dict(scored.dtypes)["prediction"] == "double" and dict(scored.dtypes)["probability"] == "vector"
        plan = scored._jdf.queryExecution().executedPlan().toString()
        assert plan.count("ArrowEvalPython") == 1, plan  # the model runs once per row for both columns
        rows = sorted(scored.select("id", "prediction", "probability").collect())
        expected = classifier.predict(features, verbose=0)
        if heads == 1:
            expected = np.concatenate([1 - expected, expected], axis=1)
        np.testing.assert_allclose([r["probability"].toArray() for r in rows], expected, atol=1e-5, rtol=0)
        assert [r["prediction"] for r in rows] == list(expected.argmax(axis=1).astype(float))
    assert 0 <= MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored) <= 1
    assert 0 <= BinaryClassificationEvaluator(rawPredictionCol="probability").evaluate(scored) <= 1


# -- bad input: a ConfigError on the driver, before any Spark job ----------------------------------

def test_a_missing_column_is_named_before_any_job(spark, fitted):
    df, model, _, _ = fitted
    keras_stage = model.stages[-1]
    with _no_job_runs(spark), pytest.raises(ConfigError, match=r"featuresCols names column\(s\) \['features'\] "
                                                                 r"that the DataFrame does not have"):
        keras_stage.transform(df)
    from stratkit.spark import KerasEstimator

    with _no_job_runs(spark), pytest.raises(ConfigError, match=r"\['price'\] of featuresCols/labelCols"):
        KerasEstimator(buildFn=ml_models.build_regressor, featuresCols=["a"], labelCols=["price"]).fit(df)


def test_a_vector_column_of_the_wrong_size_is_named_before_any_job(spark, fitted):
    from pyspark.ml.feature import VectorAssembler

    df, model, _, _ = fitted
    two = VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(df)
    with _no_job_runs(spark), pytest.raises(ConfigError, match=r"featuresCols 'features' give 2 value\(s\) per "
                                                                 r"row, but the model's input 'features' takes shape "
                                                                 r"\(3,\)"):
        model.stages[-1].transform(two)


def test_scoring_on_gpus_without_gpu_scheduling_is_refused_before_any_job(spark, fitted):
    from pyspark.ml import PipelineModel

    df, model, _, _ = fitted
    scaled = PipelineModel(stages=model.stages[:2]).transform(df)
    keras_stage = model.stages[-1]
    with _no_job_runs(spark), pytest.raises(ConfigError, match=r"useGpu=True but the Spark conf "
                                                                 r"spark.task.resource.gpu.amount is None"):
        keras_stage.copy({keras_stage.useGpu: True}).transform(scaled)


def test_a_file_that_is_not_a_keras_model_is_refused_before_any_job(spark, fitted, tmp_path):
    import zipfile

    from stratkit.spark import keras_predict

    df = fitted[0]
    text = tmp_path / "notes.keras"
    text.write_text("not a model")
    archive = tmp_path / "other.keras"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("readme.txt", "a zip, but not a Keras file")
    for path, message in ((text, "is not a Keras model file"), (archive, "without config.json and metadata.json"),
                          (tmp_path / "missing.keras", "no such file"), (tmp_path, "is a directory")):
        with _no_job_runs(spark), pytest.raises(ConfigError, match=message):
            keras_predict(df, str(path), ["a", "b", "c"])
