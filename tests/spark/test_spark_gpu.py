"""GPU scheduling, spark-tensorflow-distributor compatibility and parameter servers, on real Spark.

Spark's resource scheduling is real here: local-cluster[2,2,1024] whose workers
discover 4 FAKE GPUs each (spark_jobs/gpu_discovery.sh), executors with 4,
tasks with 2 -- so 4 task slots, limited by GPUs -- and the driver with 4.
Executors run with CUDA_VISIBLE_DEVICES=10,11,12,13, so every GPU a task gets
must come back remapped into 10..13. TensorFlow cannot use fake GPUs: the
training functions only report what they were given; no GPU training runs.

The cases are those of spark-tensorflow-distributor's integration tests
(equal split, preset CUDA_VISIBLE_DEVICES, CPU training on a GPU cluster,
local mode, num_slots <= 0, the SSL refusal and its override), plus what the
peer cannot do: Keras 3 multi-worker fit, repeated runs in reused Python
workers, a parameter-server cluster. This module runs the RDD barrier stage
(spark.stratkit.stage=rdd, where Spark reuses Python workers); the other
module runs mapInArrow. Last, scoring with `keras_predict(use_gpu=True)`: one
of each task's GPUs per Python worker, with memory growth.
"""

from __future__ import annotations

import os
import sys
import time
from unittest import mock

import cloudpickle
import pytest
from spark_helpers import FAKE_GPU_SCRIPT, start_session

from stratkit.errors import ConfigError
from stratkit.spark import MirroredStrategyRunner, SparkRunner

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PRESET = "10,11,12,13"


@pytest.fixture(scope="module")
def spark():
    script = str(FAKE_GPU_SCRIPT)
    yield from start_session("local-cluster[2,2,1024]", {
        "spark.worker.resource.gpu.amount": "4",
        "spark.worker.resource.gpu.discoveryScript": script,
        "spark.executor.resource.gpu.amount": "4",
        "spark.task.resource.gpu.amount": "2",
        "spark.driver.resource.gpu.amount": "4",
        "spark.driver.resource.gpu.discoveryScript": script,
        "spark.executorEnv.CUDA_VISIBLE_DEVICES": PRESET,
        "spark.stratkit.stage": "rdd",
    })


@pytest.fixture
def live_conf(spark):
    """Set Spark confs on the running context (a new JVM per SSL case would cost 20 s); restore after."""
    conf = spark.sparkContext._conf  # the live SparkConf: getConf() returns copies of it
    saved: dict[str, str | None] = {}

    def set_conf(key: str, value: str) -> None:
        saved.setdefault(key, conf.get(key, None))
        conf.set(key, value)

    yield set_conf
    for key, value in saved.items():
        if value is None:
            conf._jconf.remove(key)
        else:
            conf.set(key, value)


def report_visible_devices():
    import os

    print(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}", flush=True)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def _per_task(runner) -> dict[str, str]:
    """Each task's CUDA_VISIBLE_DEVICES, as its train_fn printed it (streamed to the driver)."""
    found = {}
    for label, lines in runner.last_run.tails.items():
        for line in lines:
            if line.startswith("CUDA_VISIBLE_DEVICES="):
                found[label] = line.split("=", 1)[1]
    return found


# -- spark-tensorflow-distributor's cases -------------------------------------------------------

@pytest.mark.parametrize("num_slots, per_task", [(2, [2]), (6, [2, 2, 2]), (8, [2, 2, 2, 2])])
def test_num_slots_gpus_are_split_evenly_over_tasks_and_remapped_through_the_preset(spark, num_slots, per_task):
    runner = MirroredStrategyRunner(num_slots=num_slots, use_custom_strategy=True)
    assert runner.get_num_tasks() == len(per_task)  # ceil(num_slots / spark.task.resource.gpu.amount)
    chief_value = runner.run(report_visible_devices)
    seen = _per_task(runner)
    assert [len(seen[f"worker:{rank}"].split(",")) for rank in range(len(per_task))] == per_task
    for devices in seen.values():
        ids = devices.split(",")
        assert len(set(ids)) == len(ids) and set(ids) <= set(PRESET.split(","))
    assert chief_value == seen["worker:0"]


def test_num_slots_that_would_give_tasks_different_gpu_counts_are_refused_before_any_job(spark):
    # spark-tensorflow-distributor splits 3 slots as 2 + 1 GPUs; MWMS needs as many devices on every worker
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"num_slots=3 over 2 Spark tasks gives them 2 and 1 GPUs.*Fix: num_slots a "
                                          r"multiple of spark.task.resource.gpu.amount \(e.g. num_slots=4 or 2\)"):
        MirroredStrategyRunner(num_slots=3, use_custom_strategy=True).run(report_visible_devices)
    assert time.monotonic() - started < 5


def test_more_slots_than_the_cluster_can_schedule_fail_at_once(spark):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"needs 5 concurrent task slots .* gives only 4"):
        MirroredStrategyRunner(num_slots=10).run(report_visible_devices)
    assert time.monotonic() - started < 5  # not Spark's 10-minute barrier retry loop


@pytest.mark.parametrize("num_slots", [0, -1])
def test_num_slots_must_be_positive(spark, num_slots):
    with pytest.raises(ValueError, match=f"num_slots must be a positive integer: got {num_slots}"):
        MirroredStrategyRunner(num_slots=num_slots)


def test_cpu_training_on_a_gpu_cluster_hides_the_gpus(spark):
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True)
    assert runner.get_num_tasks() == 2
    assert runner.run(report_visible_devices) == ""
    assert _per_task(runner) == {"worker:0": "", "worker:1": ""}


@pytest.mark.parametrize("num_slots", [1, 3])
@pytest.mark.parametrize("driver_preset", [None, PRESET])
def test_local_mode_uses_num_slots_of_the_drivers_gpus(spark, num_slots, driver_preset):
    patch = {"CUDA_VISIBLE_DEVICES": driver_preset} if driver_preset else {}
    with mock.patch.dict(os.environ, patch):
        if driver_preset is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        devices = MirroredStrategyRunner(num_slots=num_slots, local_mode=True,
                                         use_custom_strategy=True).run(report_visible_devices)
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == driver_preset  # the driver's own env is untouched
    ids = devices.split(",")
    assert len(set(ids)) == num_slots
    assert set(ids) <= set((driver_preset or "0,1,2,3").split(","))


def test_an_encrypted_cluster_is_refused_unless_the_override_is_set(spark, live_conf):
    live_conf("spark.ssl.enabled", "true")
    with pytest.raises(ConfigError, match=r"tensorflow.spark.distributor.ignoreSsl=true"):
        MirroredStrategyRunner(num_slots=2).run(report_visible_devices)
    with pytest.raises(ConfigError, match=r"TLS encryption enabled"):
        SparkRunner(num_workers=2).run(report_visible_devices)
    live_conf("tensorflow.spark.distributor.ignoreSsl", "true")
    assert MirroredStrategyRunner(num_slots=2, use_custom_strategy=True).run(report_visible_devices)


def test_the_ssl_override_warning_is_logged_once_on_the_peers_logger_naming_the_api_called(spark, live_conf,
                                                                                             caplog):
    live_conf("spark.ssl.enabled", "true")
    live_conf("tensorflow.spark.distributor.ignoreSsl", "true")
    with caplog.at_level("WARNING"):
        MirroredStrategyRunner(num_slots=2, use_custom_strategy=True).run(report_visible_devices)
    warnings = [r for r in caplog.records if "spark.ssl.enabled is true" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].name == "MirroredStrategyRunner"
    assert "MirroredStrategyRunner sends model parameters" in warnings[0].getMessage()


# -- SparkRunner with GPUs -------------------------------------------------------------------------

def test_spark_runner_gives_each_worker_its_spark_gpus_or_only_gpus_per_worker(spark):
    runner = SparkRunner(num_workers=2, use_gpu=True)
    runner.run(report_visible_devices)
    assert sorted(len(d.split(",")) for d in _per_task(runner).values()) == [2, 2]
    runner = SparkRunner(num_workers=2, use_gpu=True, gpus_per_worker=1)
    runner.run(report_visible_devices)
    seen = _per_task(runner)
    assert sorted(len(d.split(",")) for d in seen.values()) == [1, 1]
    assert {d for d in seen.values()} <= set(PRESET.split(","))
    with pytest.raises(ConfigError, match=r"gpus_per_worker=3 is more than the 2 GPU\(s\)"):
        SparkRunner(num_workers=2, use_gpu=True, gpus_per_worker=3).run(report_visible_devices)


# -- beyond the peer: Keras 3 multi-worker, repeated runs, parameter servers -----------------------

def keras_fit_in_the_runners_scope():
    """Plain Keras, as a spark-tensorflow-distributor user writes it: no strategy code at all."""
    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=4, verbose=0)
    return {"mwms": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
            "replicas": strategy.num_replicas_in_sync,
            "loss": history.history["loss"]}


def custom_strategy_all_reduce():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    value = strategy.run(lambda: tf.constant(1.0))
    return {"sum": float(strategy.reduce("SUM", value, axis=None))}


def test_keras3_fit_runs_multi_worker_and_a_second_run_reuses_python_workers(spark):
    wrapped = MirroredStrategyRunner(num_slots=2, use_gpu=False).run(keras_fit_in_the_runners_scope)
    assert wrapped["mwms"] and wrapped["replicas"] == 2
    assert wrapped["loss"][-1] < wrapped["loss"][0]
    # spark-tensorflow-distributor's second run in a reused Python worker fails with
    # "Collective ops are already configured"; each run here has its own training process.
    custom = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(
        custom_strategy_all_reduce)
    assert custom["sum"] == 2.0


def parameter_server_training():
    """The same Trainer script on every task: ps and workers serve, the chief coordinates `fit`."""
    import json
    import os

    import stratkit

    trainer = stratkit.Trainer()  # ps and worker tasks serve here and exit 0 when the chief is done
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (x, y), epochs=3, steps_per_epoch=10, per_replica_batch_size=32)
    return {"tf_config": json.loads(os.environ["TF_CONFIG"]), "strategy": trainer.spec.strategy,
            "loss": [float(v) for v in history.history["loss"]]}


def test_parameter_server_cluster_chief_coordinates_workers_and_ps_on_spark(spark):
    runner = SparkRunner(num_workers=2, num_ps=1)
    result = runner.run(parameter_server_training)
    cluster = result["tf_config"]["cluster"]
    assert result["tf_config"]["task"] == {"type": "chief", "index": 0}
    assert [len(cluster["chief"]), len(cluster["worker"]), len(cluster["ps"])] == [1, 2, 1]
    assert result["strategy"] == "parameter_server"
    assert result["loss"][-1] < result["loss"][0]
    assert runner.last_run.exit_codes == {"chief:0": 0, "worker:0": 0, "worker:1": 0, "ps:0": 0}
    for label in ("worker:0", "worker:1", "ps:0"):
        assert any("the chief finished training" in line for line in runner.last_run.tails[label])


# -- scoring (stratkit.spark.keras_predict / KerasModel.transform) on GPUs ------------------------
# Each Python worker starts TensorFlow on one of its task's Spark GPUs. TensorFlow cannot use the fake GPUs, so
# the model runs on the CPU; what is checked is the environment TensorFlow started with in each worker, which
# the model's probe layer (tests/spark/ml_models.py) records when the worker loads it: the task's GPU still set,
# and TensorFlow's runtime already started (it read CUDA_VISIBLE_DEVICES then).

def test_each_scoring_task_sees_one_of_its_spark_gpus_with_memory_growth(spark, tmp_path):
    import json

    import ml_models
    import numpy as np
    from pyspark.ml.feature import VectorAssembler

    from stratkit.spark import keras_predict

    cloudpickle.register_pickle_by_value(ml_models)
    log = tmp_path / "loads.jsonl"
    model = ml_models.two_inputs_two_heads(str(log))
    model.save(tmp_path / "model.keras")
    rng = np.random.default_rng(2)
    rows = [(i, [float(v) for v in rng.normal(size=4)], *map(float, rng.normal(size=3))) for i in range(40)]
    frame = spark.createDataFrame(rows, "id long, pixels array<float>, e0 double, e1 double, e2 double")
    frame = VectorAssembler(inputCols=["e0", "e1", "e2"], outputCol="extra").transform(frame.coalesce(1))
    scored = keras_predict(frame, str(tmp_path / "model.keras"), ["pixels", "extra"], use_gpu=True,
                           custom_objects={"Probe": ml_models.probe_class()})
    assert len(scored.select("prediction_price", "prediction_kind").collect()) == 40  # count() would skip the UDF
    loads = [json.loads(line) for line in log.read_text().splitlines()]
    workers = [load for load in loads if load["pid"] != os.getpid()]
    assert workers, loads
    for load in workers:
        # one GPU, one of the executor's (Spark's address translated through its CUDA_VISIBLE_DEVICES)
        assert load["visible"] in PRESET.split(","), load
        assert load["growth"] == "true", load
        assert load["started"], f"TensorFlow's runtime started after the task's GPU was set back: {load}"
