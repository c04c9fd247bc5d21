"""SparkRunner and the drop-in MirroredStrategyRunner over Spark Connect: a real local Connect server
(`SparkSession.builder.remote("local[2]")`), so there is no SparkContext on the client and the barrier stage
is `mapInArrow`.

Needs the Connect client packages (`pip install 'stratkit[spark]'` brings `pyspark[connect]`).
"""

from __future__ import annotations

import io
import socket
import sys
import time

import cloudpickle
import pytest
from spark_helpers import REPO_ROOT, processes_of_run, stop_shared_session

from stratkit.spark import MirroredStrategyRunner, SparkRunner, SparkTrainingError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    from pyspark.sql.connect.utils import check_dependencies

    try:
        check_dependencies()
    except Exception as exc:  # noqa: BLE001 - ImportError or PySparkImportError, by pyspark version
        pytest.skip(f"the Spark Connect client needs pyspark[connect]: {exc}")
    import os

    saved = {k: os.environ.get(k) for k in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "PYTHONPATH")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # The local server's Python workers import this checkout's stratkit (as spark_helpers' executors do), not the
    # one installed in the venv, which may be another worktree's. Measured: spark.executorEnv.PYTHONPATH did not reach
    # them; they inherit the JVM's environment, so this holds when this module starts the JVM (run it first, or
    # alone, from a worktree whose stratkit differs from the installed one).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                *filter(None, [saved["PYTHONPATH"]])])
    from pyspark.sql import SparkSession

    # Startup confs (BASE_CONFS) cannot be set from a Connect client; SPARK_LOCAL_IP keeps it on loopback.
    stop_shared_session()  # its local server would find a classic session's SparkContext
    session = SparkSession.builder.remote("local[2]").getOrCreate()
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mwms_digits(epochs=3):
    import stratkit

    trainer = stratkit.Trainer()
    import keras
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    trainer.fit(model, (x[:1400], y[:1400]), epochs=epochs, per_replica_batch_size=32)
    evaluation = trainer.evaluate(model, (x[1400:], y[1400:]), per_replica_batch_size=32)
    return {"accuracy": float(evaluation["accuracy"]), "replicas": trainer.num_replicas,
            "task": f"{trainer.spec.task_type}:{trainer.spec.task_index}"}


def fail_on_rank_1():
    import os
    import time

    if os.environ["STRATKIT_SPARK_RANK"] == "1":
        for i in range(150):
            print(f"worker 1 line {i}")
        raise ValueError("injected failure on worker 1")
    print("rank 0 waiting forever", flush=True)
    time.sleep(600)


def wait_for_driver(marker):
    import os
    import time

    if os.environ["STRATKIT_SPARK_RANK"] == "1":
        print("waiting for the driver to see this line", flush=True)
        deadline = time.time() + 60
        while not os.path.exists(marker):
            if time.time() > deadline:
                raise TimeoutError("the driver never saw the line: output is not streamed live")
            time.sleep(0.1)
        print("the driver saw it", flush=True)
    return "ok"


def fail_once(marker_dir):
    import os

    flag = os.path.join(marker_dir, "failed-once")
    if os.environ["STRATKIT_SPARK_RANK"] == "1" and not os.path.exists(flag):
        open(flag, "w").close()
        print("injected crash on the first attempt", flush=True)
        os._exit(7)
    return f"attempt {os.environ['STRATKIT_SPARK_ATTEMPT']}"


def say_and_gather():
    import os

    from pyspark import BarrierTaskContext

    print(f"hello from {os.environ['STRATKIT_SPARK_TASK']}", flush=True)
    context = BarrierTaskContext.get()
    return context.allGather(f"partition {context.partitionId()}")


@pytest.fixture
def unreachable_log_server(monkeypatch):
    """Tasks get the address of a port nothing listens on, as executors that cannot reach a remote client."""
    from stratkit.spark import runner as runner_module

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()
    real = runner_module._with_log_server

    def unreachable(plan, server, exchange):
        from dataclasses import replace

        return replace(real(plan, server, exchange), log_port=closed_port, rendezvous_port=closed_port)

    monkeypatch.setattr(runner_module, "_with_log_server", unreachable)


def test_two_worker_multi_worker_training_over_connect_returns_the_chiefs_result(spark, capsys):
    runner = SparkRunner(num_workers=2)
    result = runner.run(mwms_digits)
    assert runner.last_run.stage == "mapInArrow"
    assert result["task"] == "worker:0" and result["replicas"] == 2
    assert result["accuracy"] >= 0.85, result
    assert "[worker:0] Epoch 3/3" in capsys.readouterr().out
    assert processes_of_run(runner.last_run.run_id) == []


def test_a_failing_task_over_connect_raises_with_its_last_lines(spark):
    runner = SparkRunner(num_workers=2)
    started = time.monotonic()
    with pytest.raises(SparkTrainingError) as info:
        runner.run(fail_on_rank_1)
    assert (info.value.task, info.value.exit_code) == ("worker:1", 1)
    assert info.value.lines[-1] == "ValueError: injected failure on worker 1" and len(info.value.lines) == 50
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while processes_of_run(runner.last_run.run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of_run(runner.last_run.run_id) == []


def test_task_output_reaches_the_connect_client_live(spark, tmp_path, monkeypatch):
    marker = tmp_path / "driver-saw-it"
    lines: list[str] = []

    class Watcher(io.TextIOBase):
        def write(self, text):
            lines.append(text)
            if "[worker:1] waiting for the driver to see this line" in text:
                marker.touch()
            return len(text)

    monkeypatch.setattr(sys, "stdout", Watcher())
    assert SparkRunner(num_workers=2).run(wait_for_driver, str(marker)) == "ok"
    assert "[worker:1] the driver saw it" in "".join(lines)


def test_max_retries_over_connect(spark, tmp_path, capsys):
    runner = SparkRunner(num_workers=2, max_retries=1)
    assert runner.run(fail_once, str(tmp_path)) == "attempt 2"
    assert runner.last_run.attempts == 2
    assert "attempt 1 of 2 failed (task worker:1 (rank 1) failed with exit code 7" in capsys.readouterr().out


def test_drop_in_runner_and_its_task_context_over_connect(spark):
    assert MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(say_and_gather) == [
        "partition 0", "partition 1"]


def test_without_a_reachable_log_server_the_last_lines_come_with_the_result(spark, unreachable_log_server, capsys):
    runner = SparkRunner(num_workers=2)
    assert runner.run(say_and_gather) == ["partition 0", "partition 1"]
    out = capsys.readouterr().out
    assert "[worker:1] hello from worker:1" in out and "did not reach the driver live" in out
    assert "hello from worker:0" in runner.last_run.tails["worker:0"]
    assert any(e["event"] == "log server unreachable" for e in runner.last_run.timeline)


def test_without_a_reachable_log_server_the_last_lines_come_with_the_error(spark, unreachable_log_server):
    runner = SparkRunner(num_workers=2)
    with pytest.raises(SparkTrainingError) as info:
        runner.run(fail_on_rank_1)
    assert (info.value.task, info.value.rank, info.value.exit_code) == ("worker:1", 1, 1)
    assert info.value.lines[-1] == "ValueError: injected failure on worker 1"
    assert "worker 1 line 149" in info.value.lines


# -- the Spark ML stages over Connect --------------------------------------------------------------

def test_a_keras_pipeline_fits_scores_saves_and_loads_over_connect(spark, tmp_path):
    import ml_models
    import numpy as np
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from stratkit.spark import KerasEstimator

    cloudpickle.register_pickle_by_value(ml_models)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)) * [1.0, 10.0, 100.0]
    rows = [(i, *map(float, v), float(v @ [1.0, 0.1, 0.01])) for i, v in enumerate(x)]
    df = spark.createDataFrame(rows, "id long, a double, b double, c double, label double")
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"], outputCol="raw"),
                                StandardScaler(inputCol="raw", outputCol="features", withMean=True),
                                KerasEstimator(buildFn=ml_models.build_regressor, labelCols=["label"], epochs=1,
                                               batchSize=32, seed=3)])
    model = pipeline.fit(df)
    scored = sorted(model.transform(df).select("id", "features", "prediction").collect())
    features = np.array([row["features"].toArray() for row in scored], "float32")
    expected = model.stages[-1].keras_model().predict(features, verbose=0)[:, 0]
    np.testing.assert_allclose([row["prediction"] for row in scored], expected, atol=1e-5, rtol=0)
    model.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    again = dict(loaded.transform(df).select("id", "prediction").collect())
    assert all(again[row["id"]] == row["prediction"] for row in scored)


# -- a search over Connect (docs/tuning.md: SparkRunner(tune=True)) --------------------------------

@pytest.mark.tune_acceptance
def test_a_search_over_connect_runs_its_tuners_as_tasks_with_one_processs_trials(spark, tmp_path_factory, tmp_path):
    """Two tuners as mapInArrow tasks, the search service on this client: a seeded RandomSearch of 2 trials is the
    one-process search's first 2 trials (tests/engine_searches.py: trial k of a shorter search of the same seed)."""
    import engine_searches

    cloudpickle.register_pickle_by_value(engine_searches)
    reference = engine_searches.shared_reference(tmp_path_factory)["random"]
    runner = SparkRunner(num_workers=2, tune=True, timeout=900)
    result = runner.run(engine_searches.seeded_search, "random", str(tmp_path), trials=2)
    assert engine_searches.compare(result, reference, partial=True) == []
    assert runner.last_run.stage == "mapInArrow" and set(runner.last_run.exit_codes.values()) == {0}
