"""`stratkit.LocalRunner`: the cluster runners' `run(train_fn)` on local worker processes.

Real processes through `stratkit launch`'s machinery (private network, prefixed
output, restarts, root-cause report); the training functions import no TensorFlow
(the MLflow and notebook tests in tests/training/test_tracking.py train for real).
The functions here travel by value, as a script's or a notebook's do.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
from procs import child_env

from stratkit import ConfigError, LocalRunner
from stratkit.launch import LocalTrainingError

pytestmark = pytest.mark.multiworker


@pytest.fixture(autouse=True)
def by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tasks cannot import this module
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def where_am_i(tag):
    import os

    import stratkit

    spec = stratkit.detect()
    print(f"{tag} from {spec.task_type}:{spec.task_index}", flush=True)
    return {"task": f"{spec.task_type}:{spec.task_index}", "source": spec.source, "workers": spec.num_workers,
            "runner": os.environ.get("STRATKIT_RUNNER"), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_a_function_defined_in_a_script_runs_on_every_worker_and_the_chiefs_value_comes_back(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import os
        from stratkit import LocalRunner

        def train_fn(n, scale=1):            # defined in __main__: it travels by value
            import stratkit
            spec = stratkit.detect()
            print(f"hello from {spec.task_type}:{spec.task_index}", flush=True)
            return {"n": n * scale, "task": f"{spec.task_type}:{spec.task_index}", "cwd": os.getcwd()}

        if __name__ == "__main__":
            print("RESULT", LocalRunner(num_workers=2).run(train_fn, 21, scale=2))
    '''))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                            text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[worker:0] hello from worker:0" in result.stdout and "[worker:1] hello from worker:1" in result.stdout
    assert f"RESULT {{'n': 42, 'task': 'worker:0', 'cwd': '{tmp_path}'}}" in result.stdout
    # each task starts as `python -m stratkit.launch.runfn`: nothing imports that module before runpy runs it
    # (it said "RuntimeWarning: 'stratkit.launch.runfn' found in sys.modules ..." once per task)
    assert "Warning" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_with_parameter_servers_every_task_runs_and_the_chief_answers(capsys):
    runner = LocalRunner(num_workers=2, num_ps=1)
    result = runner.run(where_am_i, "hi")
    assert result == {"task": "chief:0", "source": "launch", "workers": 3, "runner": "local", "gpus": ""}
    out = capsys.readouterr().out
    for task in ("chief:0", "worker:0", "worker:1", "ps:0"):
        assert f"[{task}] hi from {task}" in out
    assert runner.last_run.succeeded and set(runner.last_run.exit_codes) == {"chief:0", "worker:0", "worker:1",
                                                                               "ps:0"}


def fails_on_worker_1():
    import stratkit

    if stratkit.detect().task_index == 1:
        raise ValueError("boom on worker 1")
    import time

    time.sleep(60)


def test_a_failure_raises_with_the_root_cause_after_the_retries():
    runner = LocalRunner(num_workers=2, max_retries=1)
    with pytest.raises(LocalTrainingError) as caught:
        runner.run(fails_on_worker_1)
    error = caught.value
    assert (error.task, error.exit_code, error.attempt, error.timed_out) == ("worker:1", 1, 2, False)
    text = str(error)
    assert text.startswith("task worker:1 exited with code 1 (attempt 2 of 2); the other tasks were stopped.")
    assert "stratkit local: root cause (first observed failure)" in text and "exception: ValueError: boom" in text
    assert error.report in text and "earlier attempts: attempt 1: worker:1 exited with code 1" in text
    assert runner.last_run.attempts == 2 and not runner.last_run.succeeded


def preempted_once():
    import os
    import sys

    if os.environ["STRATKIT_RESTART_COUNT"] == "0":
        sys.exit(75)  # what a training process does after its preemption backup
    return "resumed"


def test_a_preempted_attempt_runs_again_without_counting_against_max_retries():
    runner = LocalRunner(num_workers=2, max_retries=0)
    assert runner.run(preempted_once) == "resumed"
    assert (runner.last_run.attempts, runner.last_run.preempted) == (2, 1)


def sleeps():
    import time

    time.sleep(120)


def test_the_timeout_covers_the_whole_run_retries_included():
    runner = LocalRunner(num_workers=2, max_retries=3, timeout=3)
    started = time.monotonic()
    with pytest.raises(LocalTrainingError) as caught:
        runner.run(sleeps)
    assert caught.value.timed_out and runner.last_run.attempts == 1
    assert "did not finish within timeout=3s" in str(caught.value) and "still running after timeout=3 s" in str(
        caught.value)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(("make", "words"), [
    (lambda: LocalRunner(0), ["num_workers", "0"]),
    (lambda: LocalRunner("2"), ["num_workers", "'2'"]),
    (lambda: LocalRunner(2, num_ps=-1), ["num_ps"]),
    (lambda: LocalRunner(2, max_retries=-1), ["max_retries"]),
    (lambda: LocalRunner(2, timeout=0), ["timeout"]),
    (lambda: LocalRunner(2, gpus_per_worker=1), ["gpus_per_worker", "use_gpu=True"]),
    (lambda: LocalRunner(2, private_network="no"), ["private_network", "'no'"]),
    (lambda: LocalRunner(2).run(42), ["train_fn must be a function"]),
    (lambda: LocalRunner(2).run(where_am_i, threading.Lock()), ["args[0] cannot be pickled"]),
])
def test_bad_arguments_are_refused_before_anything_starts(make, words):
    with pytest.raises(ConfigError) as caught:
        make()
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_ctrl_c_stops_every_task_and_raises_keyboard_interrupt():
    import os
    import signal

    runner = LocalRunner(num_workers=2)
    before = signal.getsignal(signal.SIGINT)
    stop = threading.Event()

    def interrupt():    # a notebook's interrupt button, once the runner handles it (under load its start takes a
        # while, and an xdist worker ignores SIGINT before: a fixed 3 s was lost there and the tasks ran to the end)
        while not stop.is_set() and signal.getsignal(signal.SIGINT) is before:
            stop.wait(0.05)
        if not stop.is_set():
            stop.wait(1.0)      # the tasks are starting: interrupt them mid-run
            os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=interrupt, daemon=True)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(sleeps)
    finally:
        stop.set()
    assert time.monotonic() - started < 60
    assert runner.last_run.attempts == 1 and all(code != 0 for code in runner.last_run.exit_codes.values())
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def planned_here(data):
    return {"planned": data.table.planned, "rows": data.num_rows}


def test_a_table_argument_is_planned_once_by_the_driver_and_one_that_cannot_be_read_is_refused_before_any_task(
        tmp_path):
    """Each task planned its TableInput argument itself (listing the files, reading every footer), and a bad path
    was one failed task per worker, a LocalTrainingError, after every process had imported TensorFlow."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratkit.data import Table, TableInput

    (tmp_path / "t").mkdir()
    pq.write_table(pa.table({"x": np.arange(10, dtype="float32")}), tmp_path / "t" / "part-0.parquet")
    runner = LocalRunner(num_workers=2)
    assert runner.run(planned_here, TableInput(Table.parquet(str(tmp_path / "t")), features="x")) == {
        "planned": True, "rows": 10}
    first = runner.last_run
    with pytest.raises(ConfigError, match=r"table path .*missing.* does not exist. Fix"):
        runner.run(planned_here, data=TableInput(Table.parquet(str(tmp_path / "missing")), features="x"))
    assert runner.last_run is first                                  # no task was started for it
