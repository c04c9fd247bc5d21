"""SparkRunner on a real 2-executor Spark (local-cluster[2,1,1024]): training, logs, failures, retries, data.

One SparkSession for the module, shared with tests/spark/test_logserver_spark.py (same confs). The training
functions are defined in this module and shipped by value (as from a notebook or a driver script), so the
executors need no copy of the tests.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time

import cloudpickle
import pytest
from spark_helpers import processes_of_run, shared_session

from stratkit.errors import ConfigError
from stratkit.process.pump import TAIL_LINES
from stratkit.spark import DataFrameInput, SparkRunner, SparkTrainingError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    # The DataFrame barrier stage (mapInArrow), which pyspark offers only with pandas and pyarrow installed;
    # tests/spark/test_spark_gpu.py runs the RDD one.
    # The same session as tests/spark/test_logserver_spark.py (shared_session: the executors start once).
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


# -- training functions (run in the executors' training processes) ------------------------------

def train_digits(x, y, x_test, y_test, epochs=6):
    import stratkit

    trainer = stratkit.Trainer()  # before any TF op: MultiWorkerMirroredStrategy
    import keras

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (x, y), epochs=epochs, per_replica_batch_size=32)
    evaluation = trainer.evaluate(model, (x_test, y_test), per_replica_batch_size=32)
    return {"accuracy": float(evaluation["accuracy"]), "loss": [float(v) for v in history.history["loss"]],
            "num_replicas": trainer.num_replicas, "task": f"{trainer.spec.task_type}:{trainer.spec.task_index}",
            "source": trainer.spec.source, "executor_pid": os.getppid()}


def report_role():
    import json
    import os

    import stratkit

    spec = stratkit.detect()
    print(f"role {spec.task_type}:{spec.task_index} pid {os.getpid()}")
    return {"task": f"{spec.task_type}:{spec.task_index}", "source": spec.source,
            "tf_config": json.loads(os.environ["TF_CONFIG"]), "pid": os.getpid()}


def wait_for_driver(marker):
    """Rank 1 prints a line and waits until the driver has seen it (proves the log is live)."""
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


def fail_on_rank_1_while_rank_0_hangs():
    import os
    import subprocess
    import sys
    import time

    if os.environ["STRATKIT_SPARK_RANK"] == "1":
        time.sleep(1)
        for i in range(150):
            print(f"worker 1 line {i}")
        raise ValueError("injected failure on worker 1")
    # rank 0 hangs like a peer blocked in a collective, and owns a grandchild process
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("rank 0 waiting forever", flush=True)
    time.sleep(600)


def fail_once(marker_dir):
    import os

    flag = os.path.join(marker_dir, "failed-once")
    if os.environ["STRATKIT_SPARK_RANK"] == "1" and not os.path.exists(flag):
        open(flag, "w").close()
        print("injected crash on the first attempt", flush=True)
        os._exit(7)
    return f"attempt {os.environ['STRATKIT_SPARK_ATTEMPT']}"


def hang():
    import time

    print("hanging", flush=True)
    time.sleep(600)


def train_on_dataframe(data, out_dir, x_test, y_test, epochs=3, per_replica_batch=16):
    """Trains on this worker's ParquetShard and records which row ids each epoch trained on."""
    import json
    import os

    import stratkit

    trainer = stratkit.Trainer()
    import keras
    import numpy as np
    import tensorflow as tf

    seen, per_epoch = [], []

    class RecordIds(keras.layers.Layer):
        """Feature 0 is the row id: log it (on this worker's host) and pass the pixels on."""

        def call(self, inputs, training=None):
            if training:
                def log(ids):
                    seen.extend(int(i) for i in ids.numpy())
                    return np.int32(0)

                token = tf.py_function(log, [tf.cast(inputs[:, 0], tf.int64)], tf.int32)
                with tf.control_dependencies([token]):
                    return tf.identity(inputs[:, 1:])
            return inputs[:, 1:]

    class SplitEpochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(sorted(seen))
            seen.clear()

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((65,))
        hidden = keras.layers.Dense(64, activation="relu")(RecordIds()(inputs))
        model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    global_batch = per_replica_batch * trainer.num_replicas
    steps = data.steps_per_epoch(global_batch, trainer.num_replicas)
    trainer.fit(model, data.dataset_fn(global_batch), steps_per_epoch=steps, epochs=epochs,
                callbacks=[SplitEpochs()])
    rank = trainer.spec.worker_rank
    with open(os.path.join(out_dir, f"ids-{rank}.json"), "w") as handle:
        json.dump({"per_epoch": per_epoch, "shard_rows": data.num_rows, "steps": steps}, handle)
    x_with_ids = np.concatenate([np.zeros((len(x_test), 1), "float32"), x_test], axis=1)
    evaluation = trainer.evaluate(model, (x_with_ids, y_test), per_replica_batch_size=per_replica_batch)
    return {"accuracy": float(evaluation["accuracy"]), "steps": steps, "shard": repr(data)}


# -- tests -------------------------------------------------------------------------------------------

def test_two_executor_multi_worker_training_returns_the_chiefs_held_out_accuracy(spark, capsys):
    x, x_test, y, y_test = _digits()
    runner = SparkRunner(num_workers=2)
    started = time.monotonic()
    result = runner.run(train_digits, x, y, x_test, y_test)
    seconds = time.monotonic() - started
    out = capsys.readouterr().out
    assert result["task"] == "worker:0" and result["source"] == "spark"
    assert result["num_replicas"] == 2
    assert result["accuracy"] >= 0.9, result
    assert result["loss"][-1] < result["loss"][0]
    # both workers trained (Keras prints the progress on the chief; every task logs its start)
    assert "[worker:0] Epoch 6/6" in out and "[worker:1] [stratkit] worker:1 at 127.0.0.1:" in out
    assert runner.last_run.exit_codes == {"worker:0": 0, "worker:1": 0}
    assert runner.last_run.stage == "mapInArrow"
    print(f"run() took {seconds:.1f}s; accuracy {result['accuracy']:.3f}; first output after "
          f"{min(runner.last_run.first_output_seconds.values()):.1f}s", file=sys.__stderr__)


def test_each_task_logs_live_to_the_driver_with_its_prefix(spark, tmp_path, monkeypatch):
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
    text = "".join(lines)
    assert "[worker:1] the driver saw it" in text
    assert "[worker:0] [stratkit] worker:0 at" in text


def test_two_consecutive_runs_in_one_session_get_fresh_processes_and_ports(spark):
    runner = SparkRunner(num_workers=2)
    first = runner.run(report_role)
    first_id = runner.last_run.run_id
    second = runner.run(report_role)
    assert runner.last_run.run_id != first_id
    assert first["task"] == second["task"] == "worker:0" and first["source"] == "spark"
    assert first["pid"] != second["pid"]
    assert first["tf_config"]["cluster"] != second["tf_config"]["cluster"]  # new ports each run
    assert len(first["tf_config"]["cluster"]["worker"]) == 2


def test_a_failing_task_raises_with_its_last_lines_within_seconds_and_stops_the_others(spark):
    runner = SparkRunner(num_workers=2)
    started = time.monotonic()
    with pytest.raises(SparkTrainingError) as info:
        runner.run(fail_on_rank_1_while_rank_0_hangs)
    seconds = time.monotonic() - started
    error = info.value
    assert (error.task, error.rank, error.exit_code) == ("worker:1", 1, 1)
    # the launcher's tail (stratkit.process.pump: the last 50 lines) and its root-cause report format
    assert len(error.lines) == TAIL_LINES == 50 and error.lines[-1] == "ValueError: injected failure on worker 1"
    assert str(error).startswith("task worker:1 (rank 1) failed with exit code 1")
    report = str(error).splitlines()
    assert report[2] == "stratkit spark: root cause (first observed failure)"
    assert "failure: exited with code 1" in report and "exception: ValueError: injected failure on worker 1" in report
    assert "  | worker 1 line 149" in report and "  | worker 1 line 10" not in report  # only the last 50
    assert report[report.index("other tasks:") + 1].startswith("  worker:0 (rank 0): ")
    assert seconds < 30, f"took {seconds:.1f}s to report the failure"
    assert runner.last_run.exit_codes["worker:0"] == -9  # killed, not left hanging
    deadline = time.monotonic() + 10
    while processes_of_run(runner.last_run.run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of_run(runner.last_run.run_id) == []  # the grandchild is gone too


def test_max_retries_reruns_the_whole_stage_after_an_injected_failure(spark, tmp_path, capsys):
    runner = SparkRunner(num_workers=2, max_retries=1)
    assert runner.run(fail_once, str(tmp_path)) == "attempt 2"
    assert runner.last_run.attempts == 2
    assert "[stratkit] attempt 1 of 2 failed (task worker:1 (rank 1) failed with exit code 7" in capsys.readouterr().out


def test_timeout_kills_a_hung_run_and_cancels_the_job(spark):
    runner = SparkRunner(num_workers=2, timeout=6)
    started = time.monotonic()
    with pytest.raises(SparkTrainingError, match=r"did not finish within timeout=6s") as info:
        runner.run(hang)
    assert info.value.timed_out and time.monotonic() - started < 30
    assert processes_of_run(runner.last_run.run_id) == []
    assert spark.range(3).count() == 3  # the session is still usable


def test_too_few_slots_fail_before_any_job_is_submitted(spark):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"needs 3 concurrent task slots .* gives only 2"):
        SparkRunner(num_workers=3).run(report_role)
    assert time.monotonic() - started < 5


def test_an_unpicklable_argument_is_named(spark):
    with pytest.raises(ConfigError, match=r"args\[0\] cannot be pickled"):
        SparkRunner(num_workers=2).run(report_role, threading.Lock())


def test_dataframe_input_trains_and_each_row_is_seen_once_per_epoch_across_workers(spark, tmp_path):
    x, x_test, y, y_test = _digits()
    n = 1001  # odd on purpose: shards of 500 and 501 rows
    rows = [(i, [float(v) for v in x[i]], int(y[i])) for i in range(n)]
    frame = spark.createDataFrame(rows, "id long, pixels array<float>, label int").repartition(3)
    result = SparkRunner(num_workers=2).run(
        train_on_dataframe, DataFrameInput(frame, feature_cols=["id", "pixels"], label_col="label"),
        str(tmp_path), x_test, y_test)
    reports = [json.loads((tmp_path / f"ids-{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["shard_rows"] for r in reports) == [500, 501]
    assert reports[0]["steps"] == reports[1]["steps"] == 32  # ceil(500 / 16) == ceil(501 / 16)
    for epoch in range(3):
        ids = [reports[0]["per_epoch"][epoch], reports[1]["per_epoch"][epoch]]
        assert not set(ids[0]) & set(ids[1]), "two workers trained on the same row"
        assert sorted(ids[0] + ids[1]) == list(range(n)), "a row was dropped or repeated"
    assert result["accuracy"] >= 0.85, result
