"""What each barrier task does on its executor (runs inside Spark's Python worker).

Steps, in order:
  1. connect to the driver's log server (token-authenticated);
  2. hold a free port on this task's host (the address Spark's task infos
     give) until TensorFlow binds it;
  3. all-gather every task's "host:port" (BarrierTaskContext.allGather);
  4. build this task's TF_CONFIG and validate it with `stratkit.detect`;
     export this task's Spark GPUs as CUDA_VISIBLE_DEVICES (or hide GPUs);
  5. run train_fn in a fresh Python process, streaming every line to the
     driver; kill the process tree on ABORT from the driver;
  6. report the exit code; on the chief, send the pickled return value back
     as output rows, in chunks.

Why the port is held with SO_REUSEADDR, bound but not listening: measured
with TensorFlow 2.21, its gRPC server binds WITHOUT SO_REUSEPORT (TensorFlow
disables it), so a socket holding the port with SO_REUSEPORT makes
`tf.distribute.Server` fail ("Could not start gRPC server"). A SO_REUSEADDR
socket that never listens lets TensorFlow's SO_REUSEADDR listener bind, while
plain binds, other processes' `bind(port 0)` and outgoing connections' ephemeral
ports all stay off the port -- closing the probe socket before TensorFlow
starts (spark-tensorflow-distributor) leaves a window where any of them can
take it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stratkit import timeline
from stratkit.cluster.detect import LAUNCHER_VAR
from stratkit.spark import child as child_module
from stratkit.spark import layout
from stratkit.spark.layout import TaskRole
from stratkit.spark.logserver import SETUP_FAILED, LogClient

#: Bytes per output row carrying the pickled result (Spark Connect batches rows up to 4 MiB).
CHUNK_BYTES = 1 << 20
#: The `seq` of the one row every task yields about itself (JSON: its timeline, and its last lines when the
#: driver's log server could not be reached); result chunks have seq 0, 1, ...
INFO_SEQ = -1


@dataclass(frozen=True)
class TaskPlan:
    """Everything a barrier task needs, pickled into the Spark closure by the driver."""

    run_id: str
    attempt: int
    roles: tuple[TaskRole, ...]
    payload: bytes  # cloudpickled (train_fn, args, kwargs)
    log_host: str
    log_port: int
    log_token: str
    use_gpu: bool
    gpu_counts: tuple[int | None, ...]  # per rank; None = every GPU Spark gave the task
    gpu_resource_name: str = "gpu"
    wrap: str | None = None  # "multi_worker_mirrored" for MirroredStrategyRunner(use_custom_strategy=False)

    @property
    def num_tasks(self) -> int:
        return len(self.roles)


class TaskFailed(RuntimeError):
    """Raised in the Spark task so the barrier stage fails; the driver's message comes from the log server."""


def hold_port(host: str) -> tuple[socket.socket, int]:
    """Bind (never listen) a SO_REUSEADDR socket on a free port of `host`; see the module docstring."""
    holder = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind((host, 0))
    except OSError:  # a host name that does not resolve to a local interface: any interface will do
        holder.close()
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", 0))
    return holder, holder.getsockname()[1]


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _workdir() -> str:
    root = None
    try:  # Spark deletes its per-application files directory when the executor stops
        from pyspark import SparkFiles

        root = SparkFiles.getRootDirectory()
    except Exception:  # noqa: BLE001
        root = None
    return tempfile.mkdtemp(prefix="stratkit-task-", dir=root if root and os.path.isdir(root) else None)


def run_task(plan: TaskPlan, context: Any) -> Iterator[tuple[int, int, bytes]]:
    """The barrier task body; yields `(rank, seq, chunk)` rows (only rank 0 yields, its pickled result)."""
    from stratkit.spark.process import TrainingProcess

    events = [{"event": "task start", "t": time.time()}]
    rank = context.partitionId()
    role = plan.roles[rank]
    process: TrainingProcess | None = None
    aborted: list[str] = []  # set from the log client's reader thread

    def abort(reason: str) -> None:
        aborted.append(reason)
        if process is not None:
            process.kill(reason)

    def note(event: str) -> None:
        events.append({"event": event, "t": time.time()})

    client = LogClient(plan.log_host, plan.log_port, plan.log_token, rank, role.label, on_abort=abort)
    note("log server connected" if client.connected else "log server unreachable")
    workdir = _workdir()
    holder = None
    try:
        host = _host_of(context.getTaskInfos()[rank].address)
        holder, port = hold_port(host)
        gathered = context.allGather(json.dumps({"rank": rank, "address": f"{_format_host(host)}:{port}"}))
        by_rank = {item["rank"]: item["address"] for item in map(json.loads, gathered)}
        addresses = [by_rank[r] for r in range(plan.num_tasks)]
        note("addresses gathered")

        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env["CUDA_VISIBLE_DEVICES"] = _visible_devices(plan, role, context)
        spec = layout.validate(plan.roles, addresses, rank, env)
        env["TF_CONFIG"] = layout.tf_config(plan.roles, addresses, rank)
        env[LAUNCHER_VAR] = layout.LAUNCHER
        env.update(_run_env(plan, role))
        env[timeline.TIMELINE_VAR] = os.path.join(workdir, "timeline.jsonl")
        if role.trains:
            workers = [r for r in plan.roles if r.trains]
            env[child_module.SHARD_VAR] = f"{workers.index(role)}/{len(workers)}"

        with open(os.path.join(workdir, child_module.PAYLOAD), "wb") as handle:
            handle.write(plan.payload)
        client.line(f"[stratkit] {role.label} at {addresses[rank]} ({spec.strategy}, "
                    f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}, attempt {plan.attempt})")
        if aborted:
            raise TaskFailed(f"stratkit task {role.label} was stopped before training: {aborted[0]}")
        process = TrainingProcess(workdir, env, client.line)
        note("process spawned")
        if aborted:  # ABORT arrived while the process was being started
            process.kill(aborted[0])
        code = process.stream()
        note("process exited")
        if process.killed_because and code != 0:
            client.exit_code(code)
            raise TaskFailed(f"stratkit task {role.label} was stopped: {process.killed_because}")
        client.exit_code(code)
        if code != 0:
            tail = "\n".join(process.tail)
            raise TaskFailed(f"stratkit task {role.label} (rank {rank}) exited with code {code}; "
                             f"its last {len(process.tail)} lines:\n{tail}")
        if rank == 0:
            yield from _result_chunks(rank, process.result_path())
        events.extend(timeline.read(env[timeline.TIMELINE_VAR]))
        note("task end")
        info: dict[str, Any] = {"label": role.label, "events": sorted(events, key=lambda e: e["t"])}
        yield rank, INFO_SEQ, json.dumps(info).encode()
    except (TaskFailed, GeneratorExit):
        raise
    except BaseException as exc:
        client.line(f"[stratkit] task {role.label} could not start training: {type(exc).__name__}: {exc}")
        client.exit_code(SETUP_FAILED)
        raise
    finally:
        if process is not None:
            process.close()
        if holder is not None:
            holder.close()
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_env(plan: TaskPlan, role: TaskRole) -> dict[str, str]:
    env = {
        child_module.RUN_VAR: plan.run_id,
        child_module.RANK_VAR: str(role.rank),
        child_module.NUM_TASKS_VAR: str(plan.num_tasks),
        child_module.LABEL_VAR: role.label,
        child_module.ATTEMPT_VAR: str(plan.attempt),
        child_module.RESULT_VAR: "1" if role.rank == 0 else "0",
    }
    if plan.wrap:
        env[child_module.WRAP_VAR] = plan.wrap
    return env


def _visible_devices(plan: TaskPlan, role: TaskRole, context: Any) -> str:
    owned = None
    if plan.use_gpu:
        resources = context.resources()
        if plan.gpu_resource_name in resources:
            owned = list(resources[plan.gpu_resource_name].addresses)
    return layout.visible_devices(role, use_gpu=plan.use_gpu, owned=owned, count=plan.gpu_counts[role.rank],
                                  preset=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                  resource_name=plan.gpu_resource_name)


def _result_chunks(rank: int, path: str) -> Iterator[tuple[int, int, bytes]]:
    if not os.path.exists(path):
        return
    with open(path, "rb") as handle:
        seq = 0
        while True:
            chunk = handle.read(CHUNK_BYTES)
            if not chunk:
                break
            yield rank, seq, chunk
            seq += 1


def rdd_partition_function(plan: TaskPlan):
    """The function for `rdd.barrier().mapPartitions`: yields `(rank, seq, chunk)` tuples."""

    def barrier_task(_: Iterator[Any]) -> Iterator[tuple[int, int, bytes]]:
        from pyspark import BarrierTaskContext

        yield from run_task(plan, BarrierTaskContext.get())

    return barrier_task


def arrow_partition_function(plan: TaskPlan):
    """The function for `DataFrame.mapInArrow(..., barrier=True)`: yields record batches of (rank, seq, chunk)."""

    def barrier_task(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input rows only place one task per partition
            pass
        for rank, seq, chunk in run_task(plan, BarrierTaskContext.get()):
            yield pa.RecordBatch.from_pydict({"rank": [rank], "seq": [seq], "chunk": [chunk]},
                                             schema=pa.schema([("rank", pa.int32()), ("seq", pa.int32()),
                                                               ("chunk", pa.binary())]))

    return barrier_task
