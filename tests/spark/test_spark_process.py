"""The standby and the training processes it forks (`stratkit.spark.process`), without Spark.

`preload=False` keeps these fast: the standby then forks without importing TensorFlow first.
"""

from __future__ import annotations

import os
import threading
import time

import cloudpickle
import pytest

from stratkit.spark import child as child_module
from stratkit.spark.process import Standby, TrainingProcess
from procs import alive as _alive  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _workdir(tmp_path, name, fn, *args):
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / child_module.PAYLOAD).write_bytes(cloudpickle.dumps((fn, args, {})))
    return str(workdir)


def describe(tag):
    import os
    import random

    import numpy as np

    print(f"run {tag}", flush=True)
    return {"pid": os.getpid(), "tag": os.environ.get("TAG"), "tf_config": os.environ.get("TF_CONFIG"),
            "numpy": float(np.random.rand()), "random": random.random()}


def configure_tensorflow():
    import tensorflow as tf

    # Raises RuntimeError once TensorFlow's context exists: it must not exist in the standby we are forked from.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import gc

    return tf.config.threading.get_inter_op_parallelism_threads(), gc.isenabled(), gc.get_freeze_count()


def use_what_the_preload_deferred():
    import sys

    deferred_at_start = "sklearn" not in sys.modules and "matplotlib.figure" not in sys.modules
    import keras
    import sklearn.base

    return deferred_at_start, issubclass(keras.wrappers.SKLearnClassifier, sklearn.base.BaseEstimator)


def sleep_forever():
    import os
    import time

    print(f"pid {os.getpid()}", flush=True)
    time.sleep(120)


@pytest.fixture
def standby():
    standby = Standby.spawn({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, preload=False)
    yield standby
    standby.close()


def test_one_standby_forks_a_fresh_process_per_run_with_that_runs_environment(standby, tmp_path):
    results, lines = [], []
    for tag in ("a", "b"):
        workdir = _workdir(tmp_path, tag, describe, tag)
        env = {**os.environ, "TAG": tag, "TF_CONFIG": f'{{"tag": "{tag}"}}', child_module.RESULT_VAR: "1"}
        process = standby.start(workdir, env, lines.append)
        assert process.stream() == 0 and process.finished
        with open(process.result_path(), "rb") as handle:
            results.append(cloudpickle.load(handle))
        assert results[-1]["pid"] == process.pid
        process.close()
        assert standby.alive(), "the standby serves the next run"
    first, second = results
    assert lines == ["run a", "run b"]
    assert (first["tag"], second["tag"]) == ("a", "b") and second["tf_config"] == '{"tag": "b"}'
    assert first["pid"] != second["pid"] and standby.pid not in (first["pid"], second["pid"])


def test_forks_of_a_preloaded_standby_configure_tensorflow_and_draw_different_random_numbers(tmp_path):
    standby = Standby.spawn({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, preload=True)  # numpy seeded here, once
    try:
        results, lines = [], []
        for tag, fn in (("a", describe), ("b", describe), ("tf", configure_tensorflow),
                        ("deferred", use_what_the_preload_deferred)):
            env = {**os.environ, child_module.RESULT_VAR: "1"}
            process = standby.start(_workdir(tmp_path, tag, fn, *((tag,) if fn is describe else ())), env,
                                    lines.append)
            assert process.stream() == 0, lines
            with open(process.result_path(), "rb") as handle:
                results.append(cloudpickle.load(handle))
            process.close()
    finally:
        standby.close()
    first, second, (threads, collecting, frozen), deferred = results
    assert threads == 1  # TensorFlow imported in the standby, its context created only in the fork
    # The fork collects its own garbage; the standby's import-time objects are frozen, never walked.
    assert collecting and frozen > 100_000
    # As two new interpreters would: numpy's global generator is re-seeded in each fork (Python's re-seeds itself).
    assert first["numpy"] != second["numpy"] and first["random"] != second["random"]
    # scikit-learn (Keras's wrappers) was left for first use, and a run that uses it gets it (stratkit.spark.preload).
    assert deferred == (True, True)


def test_a_killed_run_reports_the_signal_and_the_standby_serves_the_next_run(standby, tmp_path):
    lines = []
    process = standby.start(_workdir(tmp_path, "slow", sleep_forever), dict(os.environ), lines.append)
    threading.Timer(1.0, process.kill, args=("stopped by the test",)).start()
    assert process.stream() == -9 and process.killed_because == "stopped by the test"
    assert _gone(process.pid) and standby.alive()
    process.close()
    again = standby.start(_workdir(tmp_path, "again", describe, "c"), dict(os.environ), lines.append)
    assert again.stream() == 0 and lines[-1] == "run c"
    again.close()


def test_a_run_killed_before_the_standby_forked_it_ends_with_the_standby(tmp_path):
    standby = Standby.spawn(dict(os.environ), preload=True)  # still importing TensorFlow when the run arrives
    process = standby.start(_workdir(tmp_path, "early", sleep_forever), dict(os.environ), lambda text: None)
    process.kill("aborted by the driver")
    assert process.stream() != 0 and process.killed_because == "aborted by the driver"
    assert not process.finished and _gone(standby.pid)
    process.close()
    standby.close()


def test_closing_the_standby_ends_the_run_it_forked(standby, tmp_path):
    lines = []
    process = standby.start(_workdir(tmp_path, "slow", sleep_forever), dict(os.environ), lines.append)
    done = []
    reader = threading.Thread(target=lambda: done.append(process.stream()))
    reader.start()
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(lines[0].split()[1])
    standby.close()
    reader.join(30)
    assert _gone(pid) and done and done[0] != 0


def test_a_process_without_a_standby_spawns_its_own_and_ends_it(tmp_path):
    process = TrainingProcess(_workdir(tmp_path, "own", describe, "d"), dict(os.environ), lambda text: None)
    assert process.stream() == 0 and process.tail == ["run d"]
    own = process.standby.pid
    process.close()
    assert _gone(own)


def test_a_function_that_cannot_be_unpickled_fails_with_the_fix(standby, tmp_path):
    workdir = tmp_path / "broken"
    workdir.mkdir()
    (workdir / child_module.PAYLOAD).write_bytes(b"not a pickle")
    lines = []
    process = standby.start(str(workdir), dict(os.environ), lines.append)
    assert process.stream() == 1
    text = "\n".join(lines)
    assert "PayloadError: could not unpickle train_fn" in text and "Fix: define train_fn" in text
    process.close()
