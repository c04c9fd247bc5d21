"""Runs on a classic SparkSession (local-cluster[2,2,1024], the RDD barrier stage): what one run leaves for the
next, BarrierTaskContext inside train_fn, the warm standby, and that nothing outlives the session.

The tests run in file order on one session; the last one stops it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import pytest
from spark_helpers import alive, processes_of_run, standby_processes, start_session

from stratkit.spark import MirroredStrategyRunner, SparkRunner

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    from pyspark import cloudpickle as spark_cloudpickle

    spark_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the peer pickles with pyspark's copy
    yield from start_session("local-cluster[2,2,1024]")


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _our_standbys() -> set[int]:
    """This session's standbys (other sessions on the machine have their own): our descendants."""
    ours = set()
    for pid in standby_processes():
        ancestor = _parent(pid)
        while ancestor > 1 and ancestor != os.getpid():
            ancestor = _parent(ancestor)
        if ancestor == os.getpid():
            ours.add(pid)
    return ours


def _gone(pids, seconds=10.0):
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


# -- functions run in the training processes -------------------------------------------------------

def use_the_task_context():
    """What spark-tensorflow-distributor users do inside train_fn."""
    import json
    import time

    from pyspark import BarrierTaskContext, TaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    if rank == 0:
        time.sleep(2)  # rank 1 must wait for this in barrier()
    entered = time.time()  # wall clock: both tasks run on this host
    context.barrier()
    left = time.time()
    gathered = context.allGather(json.dumps({"rank": rank, "entered": entered, "left": left}))
    return {"rank": rank, "gathered": sorted(gathered), "infos": [info.address for info in context.getTaskInfos()],
            "attempt": context.attemptNumber(), "same_as_task_context": TaskContext.get() is context}


def all_gather_partition_ids():
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    return context.allGather(f"partition {context.partitionId()}")


def mwms_training():
    import stratkit

    trainer = stratkit.Trainer()
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (x, y), epochs=3, per_replica_batch_size=32, verbose=0)
    return {"strategy": trainer.spec.strategy, "replicas": trainer.num_replicas,
            "loss": [float(v) for v in history.history["loss"]]}


def parameter_server_training():
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
    return {"strategy": trainer.spec.strategy, "loss": [float(v) for v in history.history["loss"]]}


def uneven_training():
    """The uneven last batch through Trainer on Spark: 7 rows, global batch 4 (the last batch 3 rows)."""
    import stratkit

    trainer = stratkit.Trainer()
    import keras
    import numpy as np

    def build():
        model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (np.eye(7, dtype="float32"), np.ones((7, 1), "float32")), epochs=2,
                          global_batch_size=4, shuffle=False, verbose=0)
    return {"replicas": trainer.num_replicas, "w": [float(v) for v in np.ravel(model.get_weights()[0])],
            "loss": [float(v) for v in history.history["loss"]]}


def report_pid():
    import os

    return os.getpid()


# -- tests ------------------------------------------------------------------------------------------

def test_two_runs_with_different_layouts_in_one_session_both_train_and_leave_nothing_running(spark):
    mwms = SparkRunner(num_workers=2)
    first = mwms.run(mwms_training)
    assert first["strategy"] == "multi_worker_mirrored" and first["replicas"] == 2
    assert first["loss"][-1] < first["loss"][0]
    ps = SparkRunner(num_workers=1, num_ps=1)
    second = ps.run(parameter_server_training)
    assert second["strategy"] == "parameter_server" and second["loss"][-1] < second["loss"][0]
    assert ps.last_run.exit_codes == {"chief:0": 0, "worker:0": 0, "ps:0": 0}
    for report in (mwms.last_run, ps.last_run):
        assert processes_of_run(report.run_id) == []
        assert len(report.pids) == len(report.tasks) and _gone(report.pids.values(), 0) == []


def test_every_run_has_a_per_phase_timeline(spark):
    runner = SparkRunner(num_workers=2)
    runner.run(mwms_training)
    events = {(e["who"], e["event"]) for e in runner.last_run.timeline}
    for who in ("worker:0", "worker:1"):
        for event in ("task start", "addresses gathered", "run handed to the process", "tensorflow imported",
                      "strategy ready", "first step begins", "first step done", "training ends", "function returns",
                      "process exited"):
            assert (who, event) in events, (who, event)
    for event in ("run() called", "slots checked", "stage submitted (attempt 1)", "run() returns"):
        assert ("driver", event) in events
    seconds = [e["s"] for e in runner.last_run.timeline]
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(runner.last_run.seconds, abs=0.5)
    returned = next(e["t"] for e in runner.last_run.timeline if e["event"] == "run() returns")
    chief_done = next(e["t"] for e in runner.last_run.timeline
                      if (e["who"], e["event"]) == ("worker:0", "function returns"))
    print(f"chief's function returned -> run() returned: {returned - chief_done:.2f}s", file=sys.__stderr__)
    assert returned - chief_done < 3.0  # 0.5 s on an idle machine; this one is shared


@pytest.mark.parametrize("api", ["SparkRunner", "MirroredStrategyRunner"])
def test_barrier_task_context_works_inside_train_fn(spark, api):
    if api == "SparkRunner":
        result = SparkRunner(num_workers=2).run(use_the_task_context)
    else:
        result = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(use_the_task_context)
    import json

    assert result["rank"] == 0 and result["attempt"] == 0 and result["same_as_task_context"]
    gathered = [json.loads(item) for item in result["gathered"]]
    assert sorted(item["rank"] for item in gathered) == [0, 1]
    rank0, rank1 = sorted(gathered, key=lambda item: item["rank"])
    assert rank1["left"] >= rank0["entered"], "barrier() returned on rank 1 before rank 0 reached it"
    assert len(result["infos"]) == 2 and all(address.startswith("127.0.0.1:") for address in result["infos"])


def test_all_gather_in_train_fn_returns_what_spark_tensorflow_distributor_returns(spark):
    peer = pytest.importorskip("spark_tensorflow_distributor")
    ours = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(all_gather_partition_ids)
    # use_custom_strategy=True: the peer imports no TensorFlow (and needs no legacy Keras) for this function.
    theirs = peer.MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(
        all_gather_partition_ids)
    assert ours == theirs == ["partition 0", "partition 1"]


def test_the_next_run_is_forked_from_the_warm_standby_and_the_conf_turns_it_off(spark):
    runner = SparkRunner(num_workers=2)
    # Spark hands a task the Python worker idle the longest (PythonWorkerFactory's idle queue is FIFO), and an
    # executor with 2 cores keeps up to 2 idle workers; earlier tests' plain Spark jobs leave workers without a
    # standby. Two runs give every idle worker of this session a standby (README: the standby is per Python
    # worker, so on multi-core executors a run can land on a worker that has none yet).
    runner.run(report_pid)
    first_pid = runner.run(report_pid)
    deadline = time.monotonic() + 10
    while len(_our_standbys()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    standbys = _our_standbys()
    assert len(standbys) >= 2
    second_pid = runner.run(report_pid)
    # A task takes the standby of the Python worker Spark runs it in (an executor with 2 cores may pick the
    # other, idle worker, which has none yet). The standby started, and imported TensorFlow, before this
    # run did: the run's process is forked from it, with nothing left to import.
    timeline = runner.last_run.timeline
    taken = {e["who"] for e in timeline if e["event"] == "standby process taken"}
    assert taken, "no task took a warm standby"
    for label in taken:
        events = {e["event"]: e["t"] for e in timeline if e["who"] == label}
        assert events["standby spawned"] < events["tensorflow imported"] < events["task start"]
        assert events["task start"] < events["process forked"] < events["function starts"]
    # Every run has its own fresh process, and the standbys stay (they are not training processes).
    assert second_pid != first_pid and not set(runner.last_run.pids.values()) & standbys
    # (Spark ends idle Python workers -- PythonWorkerFactory, after a minute -- and their standbys with them.)
    assert len(standbys & _our_standbys()) >= len(taken), "a standby ended with the run it forked"
    assert processes_of_run(runner.last_run.run_id) == []
    spark.conf.set("spark.stratkit.standby", "false")
    try:
        before = set(_our_standbys())
        runner.run(report_pid)
        events = [e["event"] for e in runner.last_run.timeline]
        assert events.count("process spawned") == 2 and "standby process taken" not in events
        time.sleep(1)
        assert set(_our_standbys()) <= before, "a standby was started though the conf turned it off"
    finally:
        spark.conf.unset("spark.stratkit.standby")


def test_an_uneven_last_batch_on_two_spark_workers_trains_as_one_process(spark, one_process_uneven):
    expected = one_process_uneven
    got = SparkRunner(num_workers=2).run(uneven_training)
    assert got["replicas"] == 2
    assert got["w"] == pytest.approx(expected["w"], abs=1e-6)
    assert got["loss"] == pytest.approx(expected["h"]["loss"], abs=1e-6)


def test_nothing_is_left_running_after_the_session_stops(spark):
    runner = SparkRunner(num_workers=2)
    runner.run(report_pid)
    deadline = time.monotonic() + 10
    while len(_our_standbys()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    standbys = _our_standbys()
    assert standbys, "a run leaves a warm standby per Python worker"
    spark.stop()
    assert _gone(standbys, 20) == [], "standby processes outlived the SparkSession"
