"""Scoring on GPUs: each Python worker starts TensorFlow on one of its task's Spark GPUs, with memory growth.

The session is tests/spark/test_spark_gpu.py's (`spark_helpers.FAKE_GPU_CONFS`): Spark's resource scheduling
is real and the GPU inventory a stand-in (a discovery script reporting 4 fake GPUs per worker, tasks with 2,
executors' CUDA_VISIBLE_DEVICES preset to 10,11,12,13). TensorFlow cannot use fake GPUs, so the model runs on
the CPU; what is checked is the environment TensorFlow was started with in each worker, which the model's
probe layer records when the worker loads it (with the task's GPU still set, and TensorFlow's runtime
already started: it read CUDA_VISIBLE_DEVICES then). No GPU ran here.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import ml_models
import numpy as np
import pytest
from spark_helpers import FAKE_GPU_CONFS, FAKE_GPU_MASTER, FAKE_GPU_PRESET, shared_session

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(ml_models)


@pytest.fixture(scope="module")
def spark():
    return shared_session(FAKE_GPU_MASTER, FAKE_GPU_CONFS)


def test_each_scoring_task_sees_one_of_its_spark_gpus_with_memory_growth(spark, tmp_path):
    from pyspark.ml.feature import VectorAssembler

    from stratkit.spark import keras_predict

    log = tmp_path / "loads.jsonl"
    model = ml_models.two_inputs_two_heads(str(log))
    model.save(tmp_path / "model.keras")
    rng = np.random.default_rng(2)
    rows = [(i, [float(v) for v in rng.normal(size=4)], *map(float, rng.normal(size=3))) for i in range(40)]
    frame = spark.createDataFrame(rows, "id long, pixels array<float>, e0 double, e1 double, e2 double")
    frame = VectorAssembler(inputCols=["e0", "e1", "e2"], outputCol="extra").transform(frame.repartition(2))
    scored = keras_predict(frame, str(tmp_path / "model.keras"), ["pixels", "extra"], use_gpu=True,
                           custom_objects={"Probe": ml_models.probe_class()})
    assert len(scored.select("prediction_price", "prediction_kind").collect()) == 40  # count() would skip the UDF
    loads = [json.loads(line) for line in log.read_text().splitlines()]
    workers = [load for load in loads if load["pid"] != os.getpid()]
    assert workers, loads
    for load in workers:
        # one GPU, one of the executor's (Spark's address translated through its CUDA_VISIBLE_DEVICES)
        assert load["visible"] in FAKE_GPU_PRESET.split(","), load
        assert load["growth"] == "true", load
        assert load["started"], f"TensorFlow's runtime started after the task's GPU was set back: {load}"
