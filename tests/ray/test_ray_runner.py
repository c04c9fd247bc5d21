"""`RayRunner` on a real local Ray: exact training, the chief's result, logs, failures, retries, refusals.

One Ray session for the module (`ray_helpers.local_ray`: loopback, token
authentication, no dashboard, nothing left running). Most cases run a train_fn
that imports no TensorFlow (a task's actor and process still start for real);
one trains 2 workers through `stratkit.Trainer` and compares them with one process.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from procs import alive
from ray_helpers import local_ray, needs_ray
from stratkit.errors import ConfigError
from stratkit.ray.failures import RayTrainingError
from stratkit.ray.runner import RayRunner

pytestmark = [pytest.mark.slow, pytest.mark.ray, needs_ray]


@pytest.fixture(scope="module")
def ray_session():
    import cloudpickle

    with local_ray() as ray:
        import ray.cloudpickle

        # train_fn travels to the tasks (and the reference to a Ray task) by value: they cannot import this module.
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.register_pickle_by_value(sys.modules[__name__])
        yield ray
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.unregister_pickle_by_value(sys.modules[__name__])


def make_data():
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    return x, (x[:, :4].sum(axis=1) > x[:, 4:].sum(axis=1)).astype("int32")


def build_model():
    import keras

    keras.utils.set_random_seed(0)  # the same initial weights in the run and in the one-process reference
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(epochs):
    import json

    import stratkit

    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    history = trainer.fit(model, make_data(), epochs=epochs, global_batch_size=64)
    weights = [w.ravel().tolist() for w in model.get_weights()]
    spec = trainer.spec
    print("TRAINED", json.dumps({"replicas": trainer.num_replicas, "sum": sum(map(sum, weights))}), flush=True)
    return {"weights": weights, "loss": history.history["loss"], "source": spec.source,
            "task": f"{spec.task_type}:{spec.task_index}", "replicas": trainer.num_replicas}


def test_two_workers_train_as_one_process_and_the_chiefs_result_comes_back(ray_session, capsys):
    ray = ray_session
    reference = ray.remote(num_cpus=1, max_calls=1)(train).remote(3)  # one process, beside the run
    runner = RayRunner(num_workers=2, timeout=300)
    got = runner.run(train, 3)
    single = ray.get(reference)
    assert got["source"] == "ray" and got["task"] == "worker:0" and got["replicas"] == 2
    assert single["replicas"] == 1
    worst = max(abs(a - b) for g, w in zip(got["weights"], single["weights"]) for a, b in zip(g, w))
    assert worst <= 1e-5, f"RayRunner 2 workers vs one process: max |diff| of weights {worst}"
    out = capsys.readouterr().out
    trained = [line for line in out.splitlines() if line.startswith("[worker:") and "TRAINED" in line]
    # Every task's output reaches the driver, prefixed; the workers ended identical.
    assert sorted(line.split(" ", 1)[0] for line in trained) == ["[worker:0]", "[worker:1]"], out[-3000:]
    assert len({line.split(" ", 1)[1] for line in trained}) == 1, trained
    assert "absl::InitializeLog" not in out  # TensorFlow's start-up noise is filtered as in the other front doors
    report = runner.last_run
    assert report.succeeded and report.attempts == 1 and set(report.nodes.values()) == {"127.0.0.1"}
    for label, pid in report.pids.items():  # fresh processes, gone after the run; so are the actors
        assert pid is not None and not alive(pid), f"{label}'s training process {pid} still runs"
    _wait_gone(report.actor_pids.values())


def parameter_server_training():
    import keras

    import stratkit

    trainer = stratkit.Trainer()  # ps and worker tasks serve here and exit 0 when the chief is done

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = trainer.build(build)
    history = trainer.fit(model, make_data(), epochs=3, steps_per_epoch=8, per_replica_batch_size=32)
    return {"strategy": trainer.spec.strategy, "source": trainer.spec.source,
            "loss": [float(v) for v in history.history["loss"]]}


def test_parameter_servers_on_ray_train_and_every_task_ends(ray_session):
    runner = RayRunner(num_workers=1, num_ps=1, timeout=300)
    got = runner.run(parameter_server_training)
    assert got["strategy"] == "parameter_server" and got["source"] == "ray"
    assert got["loss"][-1] < got["loss"][0]
    report = runner.last_run
    assert report.tasks == ["chief:0", "worker:0", "ps:0"] and report.succeeded
    for label, pid in report.pids.items():  # the ps and worker tasks served until the chief was done, then exited
        assert pid is not None and not alive(pid), label


def _wait_gone(pids, seconds=30.0):
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), f"actor processes left: {[p for p in pids if alive(p)]}"


def fail_on_worker_1(marker=None):
    import json
    import os

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] == 1 and (marker is None or not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        print("worker 1 is about to fail", flush=True)
        raise ValueError("boom on worker 1")
    return f"{task['type']}:{task['index']} done"


def test_a_failed_task_ends_the_run_with_its_root_cause(ray_session):
    with pytest.raises(RayTrainingError) as caught:
        RayRunner(num_workers=2, timeout=120).run(fail_on_worker_1)
    error = caught.value
    text = str(error)
    assert text.splitlines()[0].startswith("task worker:1 (rank 1) failed with exit code 1 on node 127.0.0.1")
    assert "stratkit ray: root cause (first observed failure)" in text
    assert "exception: ValueError: boom on worker 1" in text
    assert "worker 1 is about to fail" in text
    assert error.task == "worker:1" and error.exit_code == 1 and error.node == "127.0.0.1" and not error.lost


def test_a_retry_runs_fresh_actors_and_returns_the_chiefs_result(ray_session, tmp_path):
    # min_workers: the retry counts what the live nodes fit (here all 4 CPUs: both workers again).
    runner = RayRunner(num_workers=2, max_retries=1, min_workers=1, timeout=120)
    assert runner.run(fail_on_worker_1, str(tmp_path / "failed-once")) == "worker:0 done"
    assert runner.last_run.attempts == 2 and runner.last_run.tasks == ["worker:0", "worker:1"]


def sleep_forever():
    import time

    print("sleeping", flush=True)
    time.sleep(3600)


def test_a_lost_actor_ends_the_run_naming_the_task_and_its_node(ray_session):
    runner = RayRunner(num_workers=2, timeout=120)
    killed = []

    def kill_worker_1():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            report = runner.last_run
            if report is not None and report.pids.get("worker:1"):
                pid = report.actor_pids["worker:1"]
                os.kill(pid, 9)  # the actor's process dies, as with its node
                killed.append(pid)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_worker_1, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(RayTrainingError) as caught:
        runner.run(sleep_forever)
    thread.join()
    assert killed
    assert time.monotonic() - started < 60
    error = caught.value
    assert error.lost and error.task == "worker:1" and error.node == "127.0.0.1"
    assert str(error).splitlines()[0].startswith("task worker:1 (rank 1) was lost with node 127.0.0.1")
    assert "its Ray actor died" in str(error)
    for label, pid in runner.last_run.pids.items():  # both training processes are gone (die-with-parent, stop)
        assert not alive(pid), label


def sleep_until(marker):
    import os
    import time

    while not os.path.exists(marker):
        time.sleep(0.1)
    return "done"


def test_a_lost_actor_on_a_live_node_is_judged_alive_and_the_retry_keeps_every_worker(ray_session, tmp_path, capsys):
    # min_workers after a lost actor: before counting, the runner asks Ray about the actor's node; a probe task
    # pinned to it runs (the node lives, only the actor's process died), so the retry runs both workers again.
    runner = RayRunner(num_workers=2, max_retries=1, min_workers=1, timeout=180)
    marker = tmp_path / "go"

    def kill_worker_1():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            report = runner.last_run
            if report is not None and report.pids.get("worker:1"):
                os.kill(report.actor_pids["worker:1"], 9)
                marker.touch()  # the retry's tasks return at once
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_worker_1, daemon=True)
    thread.start()
    assert runner.run(sleep_until, str(marker)) == "done"
    thread.join()
    out = capsys.readouterr().out
    assert runner.last_run.attempts == 2 and runner.last_run.workers == [2, 2], out[-3000:]
    assert "Ray's verdict after" in out and "127.0.0.1 alive" in out, out[-3000:]
    assert "world size" not in out


def test_the_timeout_stops_every_task(ray_session):
    runner = RayRunner(num_workers=2, timeout=10)
    started = time.monotonic()
    with pytest.raises(RayTrainingError) as caught:
        runner.run(sleep_forever)
    assert caught.value.timed_out and time.monotonic() - started < 30
    assert "did not finish within timeout=10s" in str(caught.value)
    for label, pid in runner.last_run.pids.items():
        assert not alive(pid), label


def test_a_group_ray_cannot_place_is_a_config_error_within_the_timeout(ray_session):
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2, cpus_per_worker=3, timeout=3).run(fail_on_worker_1)
    assert time.monotonic() - started < 20
    text = str(caught.value)
    assert "could not place the 2 task(s)" in text and "2 x {CPU: 3}" in text and "Fix:" in text


def test_more_gpus_than_the_cluster_has_is_a_config_error(ray_session):
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2, use_gpu=True, gpus_per_worker=1).run(fail_on_worker_1)
    text = str(caught.value)
    assert "needs 2 GPU(s)" in text and "the Ray cluster has 0" in text and "Fix:" in text
