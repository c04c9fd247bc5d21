"""The Spark runner's rules without a JVM: roles and TF_CONFIGs, GPUs, slots, the log server, shards.

Fast (no Spark, no TensorFlow): the same functions the executors and the
driver call, fed the values Spark would give them.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

import stratkit
from stratkit.errors import ConfigError
from stratkit.spark import layout, slots
from stratkit.spark.logserver import LogClient, LogServer
from stratkit.spark.task import hold_port


def _addresses(n: int) -> list[str]:
    return [f"10.0.0.{i + 1}:{2220 + i}" for i in range(n)]


# -- roles and TF_CONFIG -----------------------------------------------------------------------

def test_synchronous_layout_is_all_workers_with_worker_0_as_chief():
    roles = layout.plan_roles(3)
    assert [r.label for r in roles] == ["worker:0", "worker:1", "worker:2"]
    specs = [layout.validate(roles, _addresses(3), r.rank) for r in roles]
    assert {s.strategy for s in specs} == {"multi_worker_mirrored"}
    assert {s.source for s in specs} == {"spark"}
    assert [s.is_chief for s in specs] == [True, False, False]
    assert [s.worker_rank for s in specs] == [0, 1, 2]
    config = json.loads(layout.tf_config(roles, _addresses(3), 2))
    assert config == {"cluster": {"worker": _addresses(3)}, "task": {"type": "worker", "index": 2}}


def test_parameter_server_layout_has_chief_workers_and_ps_in_rank_order():
    roles = layout.plan_roles(2, num_ps=1)
    assert [r.label for r in roles] == ["chief:0", "worker:0", "worker:1", "ps:0"]
    addresses = _addresses(4)
    configs = [json.loads(layout.tf_config(roles, addresses, r.rank)) for r in roles]
    assert configs[0]["cluster"] == {"chief": [addresses[0]], "worker": addresses[1:3], "ps": [addresses[3]]}
    assert [c["task"] for c in configs] == [{"type": "chief", "index": 0}, {"type": "worker", "index": 0},
                                            {"type": "worker", "index": 1}, {"type": "ps", "index": 0}]
    specs = [layout.validate(roles, addresses, r.rank) for r in roles]
    assert {s.strategy for s in specs} == {"parameter_server"}
    assert [s.is_chief for s in specs] == [True, False, False, False]
    # what train_fn sees through the one detection rule
    assert stratkit.detect({"TF_CONFIG": layout.tf_config(roles, addresses, 3),
                            "STRATKIT_LAUNCHER": "spark"}).task_type == "ps"


def test_a_contradicting_strategy_preset_on_the_executors_fails_the_task_before_tensorflow():
    roles = layout.plan_roles(2)
    with pytest.raises(ConfigError, match="STRATKIT_STRATEGY"):
        layout.validate(roles, _addresses(2), 1, {"STRATKIT_STRATEGY": "parameter_server"})


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 0}, r"num_workers must be an integer >= 1: got 0"),
    ({"num_workers": 2, "num_ps": -1}, r"num_ps must be an integer >= 0: got -1"),
    ({"num_workers": True}, r"num_workers must be an integer >= 1: got True"),
])
def test_bad_layout_arguments_name_the_argument_and_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        layout.plan_roles(**kwargs)


def test_runner_arguments_are_checked_before_spark_is_touched():
    from stratkit.spark import SparkRunner

    with pytest.raises(ConfigError, match="gpus_per_worker=2 needs use_gpu=True"):
        SparkRunner(2, gpus_per_worker=2)
    with pytest.raises(ConfigError, match="max_retries must be an integer >= 0: got -1"):
        SparkRunner(2, max_retries=-1)
    with pytest.raises(ConfigError, match="timeout must be a positive number of seconds or None: got 0"):
        SparkRunner(2, timeout=0)
    assert SparkRunner(2, num_ps=2).num_tasks == 5  # chief + 2 workers + 2 ps


# -- GPUs ------------------------------------------------------------------------------------------

def test_gpu_split_is_as_even_as_possible_larger_first():
    assert [layout.split_evenly(6, 2, i) for i in range(2)] == [3, 3]
    assert [layout.split_evenly(5, 2, i) for i in range(2)] == [3, 2]
    assert [layout.split_evenly(3, 2, i) for i in range(2)] == [2, 1]


def test_visible_devices_use_the_task_gpus_remapped_through_a_preset():
    worker, ps = layout.TaskRole(0, "worker", 0), layout.TaskRole(1, "ps", 0)
    assert layout.visible_devices(worker, use_gpu=True, owned=["3", "1"], count=None, preset=None) == "1,3"
    assert layout.visible_devices(worker, use_gpu=True, owned=["3", "1"], count=1, preset=None) == "1"
    # Spark counts the executor's visible devices: address 2 of "10,11,12,13" is device 12
    assert layout.visible_devices(worker, use_gpu=True, owned=["2", "0"], count=None,
                                  preset="10,11,12,13") == "10,12"
    assert layout.visible_devices(worker, use_gpu=False, owned=["0"], count=None, preset="10") == ""
    assert layout.visible_devices(ps, use_gpu=True, owned=["0"], count=None, preset=None) == ""


@pytest.mark.parametrize("call, message", [
    (lambda: layout.check_gpu_addresses(["0", "01"]), r"\['01'\] are not CUDA device ordinals"),
    (lambda: layout.remap_visible(["4"], "10,11"), r"address 4 .*CUDA_VISIBLE_DEVICES='10,11'.* lists only 2"),
    (lambda: layout.visible_devices(layout.TaskRole(0, "worker", 0), use_gpu=True, owned=None, count=None,
                                    preset=None), r"spark.task.resource.gpu.amount"),
    (lambda: layout.visible_devices(layout.TaskRole(0, "worker", 0), use_gpu=True, owned=["0"], count=2,
                                    preset=None), r"should use 2 GPU\(s\) but Spark gave it 1"),
])
def test_gpu_errors_say_what_is_wrong_and_the_fix(call, message):
    with pytest.raises(ConfigError, match=message) as info:
        call()
    assert "Fix:" in str(info.value)


# -- slots -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("confs, expected", [
    ({"spark.master": "local"}, 1),
    ({"spark.master": "local[4]"}, 4),
    ({"spark.master": "local[4, 3]"}, 4),
    ({"spark.master": "local[*]"}, 8),
    ({"spark.master": "local[4]", "spark.task.cpus": "2"}, 2),
    ({"spark.master": "local-cluster[2,1,1024]"}, 2),
    ({"spark.master": "local-cluster[3,4,1024]", "spark.task.cpus": "2"}, 6),
    ({"spark.master": "local-cluster[2,2,1024]", "spark.executor.resource.gpu.amount": "4",
      "spark.task.resource.gpu.amount": "4"}, 2),  # GPUs, not cores, limit each executor to one task
    ({"spark.master": "yarn", "spark.executor.instances": "3", "spark.executor.cores": "2"}, 6),
    ({"spark.master": "yarn", "spark.executor.instances": "3", "spark.dynamicAllocation.enabled": "true"}, None),
    ({"spark.master": "spark://master:7077"}, None),
])
def test_static_slots_from_master_and_confs(confs, expected):
    assert slots.static_slots(confs, cpu_count=8) == expected


class _FakeContext:
    """Stands in for Spark's maxNumConcurrentTasks as executors register."""

    def __init__(self, counts):
        self.counts = list(counts)

    @property
    def _jsc(self):
        return self

    def sc(self):
        return self

    def resourceProfileManager(self):
        return self

    def defaultResourceProfile(self):
        return None

    def maxNumConcurrentTasks(self, _profile):
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def test_too_few_slots_fail_at_once_when_the_confs_show_it():
    with pytest.raises(ConfigError, match=r"needs 3 concurrent task slots .* gives only 2 .*local-cluster\[N,CORES"):
        slots.check_slots(3, {"spark.master": "local-cluster[2,1,1024]"}, _FakeContext([2]))


def test_slot_check_waits_for_executors_to_register_then_passes_or_explains():
    naps = []
    assert slots.check_slots(2, {"spark.master": "spark://m:7077"}, _FakeContext([0, 1, 2]), wait_seconds=5,
                             sleep=naps.append) == 2
    assert len(naps) == 2
    with pytest.raises(ConfigError, match=r"registered executors offer 1 \(waited 0s"):
        slots.check_slots(2, {"spark.master": "spark://m:7077"}, _FakeContext([1]), wait_seconds=0)


# -- the port holder -------------------------------------------------------------------------------

def test_held_port_refuses_plain_binds_and_is_never_handed_out_but_admits_a_reuseaddr_listener():
    holder, port = hold_port("127.0.0.1")
    try:
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
        handed_out = set()
        for _ in range(200):
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            handed_out.add(probe.getsockname()[1])
            probe.close()
        assert port not in handed_out
        # what TensorFlow's gRPC server does: SO_REUSEADDR, bind 0.0.0.0:port, listen
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        server.close()
    finally:
        holder.close()


# -- the log server --------------------------------------------------------------------------------

class _Sink:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def _wait(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_log_server_prefixes_lines_tracks_exit_codes_and_relays_abort():
    sink, exits, aborted = _Sink(), [], []
    server = LogServer("127.0.0.1", on_exit=lambda task: exits.append((task.label, task.exit_code)), stream=sink)
    client = LogClient("127.0.0.1", server.port, server.token, 1, "worker:1", on_abort=aborted.append)
    try:
        client.line("epoch 1: loss 0.5")
        client.line("progress\r")
        client.exit_code(3)
        assert _wait(lambda: exits == [("worker:1", 3)])
        assert "[worker:1] epoch 1: loss 0.5\n[worker:1] progress\n" in sink.text
        assert list(server.tasks[1].tail) == ["epoch 1: loss 0.5", "progress"]
        assert server.abort_all("worker:0 failed") == 1
        assert _wait(lambda: aborted == ["worker:0 failed"])
    finally:
        client.close()
        server.shutdown()


def test_log_server_ignores_connections_without_the_run_token():
    sink = _Sink()
    server = LogServer("127.0.0.1", stream=sink)
    try:
        intruder = LogClient("127.0.0.1", server.port, "0" * 32, 0, "worker:0")
        intruder.line("injected")
        intruder.exit_code(1)
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.sendall(b"L no hello at all\n")
        assert _wait(lambda: server.rejected == 2)
        intruder.close()
        raw.close()
        assert sink.text == "" and server.tasks == {}
    finally:
        server.shutdown()


def test_log_client_without_a_driver_falls_back_to_stderr(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = LogClient("127.0.0.1", port, "t", 0, "worker:0", timeout=1)
    client.line("still visible")
    client.close()
    err = capsys.readouterr().err
    assert "cannot reach the driver's log server" in err and "[worker:0] still visible" in err


# -- DataFrame shards (pyarrow only) -----------------------------------------------------------------

def _staged(tmp_path, sizes, row_group=7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratkit.spark.data import StagedData

    files, start = [], 0
    for i, size in enumerate(sizes):
        ids = list(range(start, start + size))
        table = pa.table({"id": pa.array(ids, pa.int64()),
                          "vec": pa.array([[float(v), -float(v)] for v in ids], pa.list_(pa.float32())),
                          "label": pa.array([v % 3 for v in ids], pa.int32())})
        path = tmp_path / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        files.append((path.as_uri(), size))
        start += size
    return StagedData(path=str(tmp_path), files=tuple(files), feature_cols=("id", "vec"), label_col="label")


def test_shards_cover_every_row_once_in_contiguous_near_equal_ranges(tmp_path):
    staged = _staged(tmp_path, [10, 0, 23, 4])  # 37 rows, an empty file, row groups of 7
    seen = []
    for index in range(3):
        shard = staged.shard(index, 3)
        x, y = shard.to_numpy()
        assert x.shape == (shard.num_rows, 3) and x.dtype == "float32"
        assert (x[:, 1] == x[:, 0]).all() and (x[:, 2] == -x[:, 0]).all()  # [id, vec...] in feature order
        assert (y == x[:, 0].astype(int) % 3).all()
        seen.append(x[:, 0].astype(int).tolist())
    assert [len(s) for s in seen] == [12, 12, 13]
    assert [row for shard_ids in seen for row in shard_ids] == list(range(37))


@pytest.mark.parametrize("rows, workers, global_batch, replicas, steps", [
    (203, 2, 32, None, 7),   # shards 101/102 -> 7 batches of 16 each: every row once
    (200, 2, 32, None, 7),   # 100/100 -> 6 full + 1 partial
    (97, 2, 32, None, 3),    # 48/49: 49 needs a 4th batch of 1 that 48 cannot match -> skipped
    (64, 2, 32, 4, 2),       # 2 replicas per worker: 32 rows = 4 batches of 8 = 2 steps
])
def test_steps_per_epoch_is_the_same_on_every_worker(tmp_path, rows, workers, global_batch, replicas, steps):
    staged = _staged(tmp_path, [rows])
    assert {staged.shard(i, workers).steps_per_epoch(global_batch, replicas) for i in range(workers)} == {steps}


def test_shard_batch_errors_name_the_value_and_fix(tmp_path):
    shard = _staged(tmp_path, [10]).shard(0, 2)
    with pytest.raises(ConfigError, match=r"global_batch_size=33 does not split evenly over 2 replicas"):
        shard.steps_per_epoch(33)
    with pytest.raises(ConfigError, match=r"global_batch_size=64 leaves no full step"):
        shard.steps_per_epoch(64, num_replicas=4)  # 5 rows cannot feed 2 local replicas of 16
    with pytest.raises(ConfigError, match=r"num_replicas=3 is not a multiple of the 2 workers"):
        shard.steps_per_epoch(30, num_replicas=3)


def test_importing_stratkit_spark_loads_neither_pyspark_nor_tensorflow():
    import subprocess

    code = ("import sys, stratkit, stratkit.spark; "
            "print([m for m in ('pyspark', 'tensorflow', 'keras') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the failure message: the launcher's root-cause report ------------------------------------------

def test_a_task_failure_reads_as_the_launchers_root_cause_report_with_the_exception_out_of_the_tail():
    from stratkit.process.pump import TAIL_LINES
    from stratkit.process.report import TaskFailure, format_failure_report
    from stratkit.spark.failures import AttemptState, explain

    roles = layout.plan_roles(2)
    state = AttemptState()
    def on_exit(task):  # as the runner: the first failure is the root cause
        if task.exit_code and state.failure is None:
            state.failure = task

    server = LogServer("127.0.0.1", stream=_Sink(), on_exit=on_exit)
    clients = [LogClient("127.0.0.1", server.port, server.token, rank, f"worker:{rank}") for rank in (0, 1)]
    try:
        for text in ["Traceback (most recent call last):", '  File "train.py", line 3', "ValueError: bad batch"]:
            clients[1].line(text)
        for i in range(TAIL_LINES + 10):  # e.g. TensorFlow's shutdown noise: the exception leaves the tail
            clients[1].line(f"noise {i}")
        clients[1].exit_code(1)
        assert _wait(lambda: state.failure is not None)
        clients[0].exit_code(-9)  # what a task reports after killing its process on the driver's ABORT
        assert _wait(lambda: server.tasks[0].exit_code == -9)
    finally:
        for client in clients:
            client.close()
        server.shutdown()
    error = explain(RuntimeError("barrier stage failed"), state, server, roles, attempt=1, attempts=2, timeout=None)
    summary, *report = str(error).splitlines()
    assert summary == "task worker:1 (rank 1) failed with exit code 1 (attempt 1 of 2); the other tasks were stopped."
    assert (error.task, error.rank, error.exit_code, error.attempt) == ("worker:1", 1, 1, 1)
    assert len(error.lines) == TAIL_LINES and error.lines[-1] == f"noise {TAIL_LINES + 9}"
    expected = format_failure_report(
        TaskFailure("worker:1", 1, tuple(error.lines), exception=("ValueError: bad batch", "noise 0", "noise 1",
                                                                  "noise 2", "noise 3")),
        ["worker:0 (rank 0): stopped by the runner after worker:1 failed (SIGKILL)"], attempts=2,
        title="stratkit spark")
    assert "\n".join(report) == expected


def test_a_stage_that_fails_before_any_task_reports_shows_what_spark_said_in_the_same_report():
    from stratkit.spark.failures import AttemptState, explain

    server = LogServer("127.0.0.1", stream=_Sink())
    server.shutdown()
    spark_said = "Job aborted\n\tat org.apache.spark.Foo(Foo.scala:1)\nModuleNotFoundError: No module named 'stratkit'"
    message = str(explain(RuntimeError(spark_said), AttemptState(), server, layout.plan_roles(2), attempt=1, attempts=1,
                          timeout=None))
    assert message.splitlines()[2] == "stratkit spark: root cause (first observed failure)"
    assert "failure: Spark failed the barrier stage before a training process reported its exit" in message
    assert "  | ModuleNotFoundError: No module named 'stratkit'" in message and "Foo.scala" not in message
    assert "Fix: the executors' Python cannot import a module" in message


def test_every_task_refuses_a_cluster_whose_training_tasks_see_different_gpu_counts():
    roles = layout.plan_roles(2, num_ps=1)  # chief, worker:0, worker:1, ps:0
    layout.check_gpu_counts(roles, [2, 2, 2, 0])  # ps tasks get none by design
    with pytest.raises(ConfigError) as info:
        layout.check_gpu_counts(roles, [2, 2, 0, 0])
    message = str(info.value)
    assert "chief:0: 2 GPU(s), worker:0: 2 GPU(s), worker:1: 0 GPU(s)" in message
    assert "mixing GPU and CPU-only workers" in message and "Fix:" in message
    with pytest.raises(ConfigError, match="worker:1: 1 GPU.*different GPU counts"):
        layout.check_gpu_counts(layout.plan_roles(2), [2, 1])
    assert layout.gpu_count("") == 0 and layout.gpu_count("10,11") == 2
