"""What each barrier task does on its executor (runs inside Spark's Python worker).

Steps, in order:
  1. get the standby that forks the training process: the Python worker's
     warm standby (TensorFlow and Keras already imported), else spawn one
     now -- it imports them while the steps below run;
  2. connect to the driver's log server (token-authenticated);
  3. hold a free port on this task's host (the address Spark's task infos
     give) until TensorFlow binds it;
  4. exchange every task's "host:port" through the driver
     (`stratkit.spark.rendezvous`), else with BarrierTaskContext.allGather;
  5. build this task's TF_CONFIG and validate it with `stratkit.detect`;
     export this task's Spark GPUs as CUDA_VISIBLE_DEVICES (or hide GPUs);
     serve the task's BarrierTaskContext to the process (`stratkit.spark.context`);
  6. have the standby fork the run's training process (environment,
     payload), stream every line to the driver; kill the process group on
     ABORT from the driver; pass SIGTERM or SIGHUP to this Python worker (an
     executor stopping) on to the training process as a preemption notice,
     and tell the driver;
  7. report the exit code (after an exit 75, wait for the driver's word, so
     Spark does not kill the other tasks while they write their backups); on
     the chief, send the pickled return value back as output rows, in chunks;
     every task also returns one info row (its timeline, and its last lines
     when the driver could not see them live);
  8. keep the standby for the next run (unless spark.stratkit.standby=false):
     it forks that run's process too, so no TensorFlow import runs beside
     training and none is left to wait for.

The task's port is held until TensorFlow binds it (`stratkit.process.ports`
says why and how).

Size: over 400 lines because the task body (`run_task`) and the executor's
warm standby it takes and keeps read best beside each other; the process
itself is `spark/process.py`, the wire format `spark/logprotocol.py`.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from stratkit import status, timeline
from stratkit.cluster.detect import LAUNCHER_VAR
from stratkit.process import ports
from stratkit.process.children import passing_on_notices
from stratkit.process.report import PREEMPTED_GRACE, describe_returncode, is_preempted, signal_name
from stratkit.spark import child as child_module
from stratkit.spark import layout
from stratkit.spark.layout import TaskRole
from stratkit.spark.logprotocol import SETUP_FAILED, TAIL_LINES, LogClient
from stratkit.strategy.server import RUN_DIR_VAR

#: The rows every task yields (its rank, a sequence number, a chunk of bytes), as a Spark schema.
ROWS = "rank int, seq int, chunk binary"
#: Bytes per output row carrying the pickled result (Spark Connect batches rows up to 4 MiB).
CHUNK_BYTES = 1 << 20
#: The `seq` of the one row every task yields about itself (JSON: its timeline, and its last lines when the
#: driver's log server could not be reached); result chunks have seq 0, 1, ...
INFO_SEQ = -1
#: Seconds a task tries to reach the driver's log server before training without live output.
LOG_CONNECT_SECONDS = 5.0
#: Starts the task failure record at the end of a failed task's error message (see `failure_record`).
FAILURE_MARKER = "[stratkit-task-failure] "
#: Signals that tell this task's Python worker to go, passed on to the training process as a preemption notice:
#: SIGTERM (to the worker), SIGHUP (what Spark's Python daemon sends its workers when the executor stops, after
#: the executor's own SIGTERM) and STRATKIT_PREEMPTION_SIGNAL (read when the task runs).
NOTICES = (signal.SIGTERM, signal.SIGHUP)


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
    preload: bool = True  # the training process imports TensorFlow and Keras while the task prepares its run
    rendezvous_port: int = 0  # the driver's address exchange (stratkit.spark.rendezvous); 0: Spark's all-gather
    rendezvous_token: str = ""
    standby: bool = True  # keep a warm standby process in the Spark Python worker for the next run
    extra_env: tuple[tuple[str, str], ...] = ()  # the driver's MLflow run for the chief (training.tracking.handoff)

    @property
    def num_tasks(self) -> int:
        return len(self.roles)


class TaskFailed(RuntimeError):
    """Raised in the Spark task so the barrier stage fails; the driver's message comes from the log server."""


def hold_port(host: str) -> tuple[socket.socket, int]:
    """A free port of `host` held for this task's TensorFlow server (`stratkit.process.ports.hold_port`), and its
    number; a host Spark names that is not an address of this machine: any interface's."""
    try:
        holder = ports.hold_port(host)
    except OSError:
        holder = ports.hold_port("0.0.0.0")
    return holder, holder.getsockname()[1]


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def task_workdir() -> str:
    """A fresh directory for one run's payload and result, as an absolute path: Spark's file root is "." on a
    cluster's executors, and the training process may change its working directory (a search's function does)."""
    root = None
    try:  # Spark deletes its per-application files directory when the executor stops
        from pyspark import SparkFiles

        root = SparkFiles.getRootDirectory()
    except Exception:  # noqa: BLE001
        root = None
    made = tempfile.mkdtemp(prefix="stratkit-task-", dir=root if root and os.path.isdir(root) else None)
    return os.path.abspath(made)


def run_task(plan: TaskPlan, context: Any) -> Iterator[tuple[int, int, bytes]]:
    """The barrier task body; yields `(rank, seq, chunk)` rows: rank 0's pickled result, and one info row each."""
    from stratkit.spark.context import CONTEXT_VAR, ContextServer

    events = [{"event": "task start", "t": time.time()}]
    rank = context.partitionId()
    role = plan.roles[rank]
    aborted: list[str] = []  # set from the log client's reader thread

    def note(event: str) -> None:
        events.append({"event": event, "t": time.time()})

    # First, so its TensorFlow import overlaps with everything below.
    standby, how = standby_for(plan)
    note(how)
    events.append({"event": "standby spawned", "t": standby.spawned_at})
    process = None

    told = threading.Event()  # the driver's word (ABORT, or the connection closed)

    def abort(reason: str) -> None:
        aborted.append(reason)
        told.set()
        if process is not None:
            process.kill(reason)

    client = LogClient(plan.log_host, plan.log_port, plan.log_token, rank, role.label, on_abort=abort,
                       timeout=LOG_CONNECT_SECONDS)
    note("log server connected" if client.connected else "log server unreachable")
    workdir = task_workdir()
    holder = None
    context_server = None
    lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)  # kept for the driver when not live

    def line(text: str) -> None:
        lines.append(text)
        client.line(text)

    try:
        host = _host_of(context.getTaskInfos()[rank].address)
        holder, port = hold_port(host)
        visible = _visible_devices(plan, role, context)
        addresses, gpu_counts = _gather_addresses(plan, context, rank, f"{_format_host(host)}:{port}",
                                                  layout.gpu_count(visible))
        note("addresses gathered")
        layout.check_gpu_counts(plan.roles, gpu_counts)  # every task refuses the same mixed cluster

        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env["CUDA_VISIBLE_DEVICES"] = visible
        spec = layout.validate(plan.roles, addresses, rank, env)
        env["TF_CONFIG"] = layout.tf_config(plan.roles, addresses, rank)
        env[LAUNCHER_VAR] = layout.LAUNCHER
        env.update(_run_env(plan, role))
        if role.trains:
            workers = [r for r in plan.roles if r.trains]
            env[child_module.SHARD_VAR] = f"{workers.index(role)}/{len(workers)}"
        env[timeline.TIMELINE_VAR] = os.path.join(workdir, "timeline.jsonl")
        context_server = ContextServer(context)
        env[CONTEXT_VAR] = context_server.address

        with open(os.path.join(workdir, child_module.PAYLOAD), "wb") as handle:
            handle.write(plan.payload)
        line(f"[stratkit] {role.label} at {addresses[rank]} ({spec.strategy}, "
             f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}, attempt {plan.attempt})")
        if aborted:
            raise TaskFailed(f"stratkit task {role.label} was stopped before training: {aborted[0]}")

        def tell_driver(signum: int) -> None:  # from a signal handler: the client's lock may be held here
            threading.Thread(target=client.notice, args=(signal_name(signum),), daemon=True).start()

        with passing_on_notices(lambda: process.pid if process is not None else None,
                                (*NOTICES, *status.preemption_signals()), tell_driver) as notices:
            process = standby.start(workdir, env, line)
            note("run handed to the process")
            if aborted:  # ABORT arrived while the process was being started
                process.kill(aborted[0])
            code = process.stream()
        note("process exited")
        if notices:
            line(f"[stratkit] {role.label}: this task's Python worker got {signal_name(notices[0])}: passed on to "
                 f"its training process as a preemption notice (SIGTERM); it {describe_returncode(code)}")
        client.exit_code(code)
        if is_preempted(code) and client.connected:
            # The other tasks stop at the same step and write their backups too: Spark must not kill them (it
            # kills a barrier stage's other tasks when one fails) before the driver has heard every exit.
            told.wait(PREEMPTED_GRACE)
        if process.killed_because and code != 0:
            raise TaskFailed(f"stratkit task {role.label} was stopped: {process.killed_because}"
                             + failure_record(role, code, lines))
        if code != 0:
            raise TaskFailed(f"stratkit task {role.label} (rank {rank}) exited with code {code}; "
                             f"its last {len(lines)} lines:\n" + "\n".join(lines) + failure_record(role, code, lines))
        if rank == 0:
            yield from result_chunks(rank, process.result_path())
        events.extend(timeline.read(env[timeline.TIMELINE_VAR]))
        note("task end")
        info: dict[str, Any] = {"label": role.label, "pid": process.pid,
                                "events": sorted(events, key=lambda e: e["t"])}
        if not client.connected or client.error:  # the driver saw none or only part of the output live
            info["tail"] = list(lines)
            info["log_error"] = client.error
        yield rank, INFO_SEQ, json.dumps(info).encode()
    except (TaskFailed, GeneratorExit):
        raise
    except Exception as exc:  # noqa: BLE001 - reported with its type; Spark's own interrupts pass below
        message = f"[stratkit] task {role.label} could not start training: {type(exc).__name__}: {exc}"
        line(message)
        client.exit_code(SETUP_FAILED)
        raise TaskFailed(message + failure_record(role, SETUP_FAILED, lines)) from exc
    except BaseException:
        client.exit_code(SETUP_FAILED)
        raise
    finally:
        if process is not None:
            process.close()
        keep_or_close(plan, standby, process)
        if context_server is not None:
            context_server.close()
        if holder is not None:
            holder.close()
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)
        try:  # once every marker was read (a task still waiting for its marker keeps it)
            os.rmdir(_run_env(plan, role)[RUN_DIR_VAR])
        except OSError:
            pass


def _gather_addresses(plan: TaskPlan, context: Any, rank: int, address: str,
                      gpus: int = 0) -> tuple[list[str], list[int]]:
    """Every rank's "host:port" and GPU count: through the driver (no barrier wait), else Spark's all-gather."""
    from stratkit.spark import rendezvous

    mine = json.dumps({"address": address, "gpus": gpus}, separators=(",", ":"))
    members = rendezvous.exchange(plan.log_host, plan.rendezvous_port, plan.rendezvous_token, rank, mine)
    if members is not None and len(members) == plan.num_tasks:
        parsed = [json.loads(m) for m in members]
        return [p["address"] for p in parsed], [int(p["gpus"]) for p in parsed]
    gathered = context.allGather(json.dumps({"rank": rank, "address": address, "gpus": gpus}))
    by_rank = {item["rank"]: item for item in map(json.loads, gathered)}
    return ([by_rank[r]["address"] for r in range(plan.num_tasks)],
            [int(by_rank[r]["gpus"]) for r in range(plan.num_tasks)])


def failure_record(role: TaskRole, exit_code: int, lines: Any) -> str:
    """The machine-readable end of a task's error message: the driver rebuilds SparkTrainingError from it
    when the log server could not deliver the task's exit code and lines (e.g. Spark Connect executors
    that cannot reach the client)."""
    record = {"label": role.label, "rank": role.rank, "exit_code": exit_code, "lines": list(lines)}
    return "\n" + FAILURE_MARKER + json.dumps(record) + "\n"


def parse_failure_record(text: str) -> dict[str, Any] | None:
    """The first task failure record in a Spark error message, or None."""
    start = text.find(FAILURE_MARKER)
    while start >= 0:
        end = text.find("\n", start)
        try:
            record = json.loads(text[start + len(FAILURE_MARKER): end if end >= 0 else None])
            if isinstance(record, dict) and "label" in record:
                return record
        except ValueError:
            pass
        start = text.find(FAILURE_MARKER, start + 1)
    return None


# -- the executor's warm standby -------------------------------------------------------------------
# One standby per Spark Python worker (which runs one task at a time): an interpreter with TensorFlow and
# Keras imported that forks each run's training process (`stratkit.spark.process`). It is this worker's
# child and dies with it (`stratkit.process.children.start_child`), so it never outlives the executor; a
# process it forked dies with it.
_standby: dict[str, Any] = {}


def _standby_key(plan: TaskPlan) -> tuple:
    from stratkit.spark.process import python_path

    env = tuple(sorted((k, v) for k, v in os.environ.items() if k != "TF_CONFIG"))
    return sys.executable, python_path(), env, plan.preload


def standby_for(plan: TaskPlan) -> tuple[Any, str]:
    """The standby to fork this task's training process from: the worker's when it fits, else a new one."""
    from stratkit.spark.process import Standby

    standby = _standby.pop("standby", None)
    key = _standby.pop("key", None)
    if standby is not None:
        if plan.standby and key == _standby_key(plan) and standby.alive():
            return standby, "standby process taken"
        standby.close()
    base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return Standby.spawn(base, preload=plan.preload), "process spawned"


def keep_or_close(plan: TaskPlan, standby: Any, process: Any) -> None:
    """Keep the standby for the next run when it is wanted and idle again (it reported this run's exit)."""
    if plan.standby and standby.alive() and (process is None or process.finished) and "standby" not in _standby:
        _standby["standby"] = standby
        _standby["key"] = _standby_key(plan)
    else:
        standby.close()


def _run_env(plan: TaskPlan, role: TaskRole) -> dict[str, str]:
    env = {
        **dict(plan.extra_env),
        child_module.RUN_VAR: plan.run_id,
        child_module.RANK_VAR: str(role.rank),
        child_module.NUM_TASKS_VAR: str(plan.num_tasks),
        child_module.LABEL_VAR: role.label,
        child_module.ATTEMPT_VAR: str(plan.attempt),
        child_module.RESULT_VAR: "1" if role.rank == 0 else "0",
    }
    if plan.wrap:
        env[child_module.WRAP_VAR] = plan.wrap
    # The done markers' private directory: one fresh name per attempt, the same on every task (the chief
    # writes into it on each task's host); each ps/worker task creates it, 0700, before serving.
    env[RUN_DIR_VAR] = os.path.join(tempfile.gettempdir(), f"{plan.run_id}-attempt{plan.attempt}-markers")
    return env


def _visible_devices(plan: TaskPlan, role: TaskRole, context: Any) -> str:
    return context_devices(context, role, use_gpu=plan.use_gpu, count=plan.gpu_counts[role.rank],
                           resource_name=plan.gpu_resource_name)


def context_devices(context: Any, role: TaskRole, *, use_gpu: bool, count: int | None, resource_name: str) -> str:
    """A Spark task's training process's CUDA_VISIBLE_DEVICES: the GPUs Spark gave the task (`context`), by
    `layout.visible_devices`' rule (a barrier task's and a search's tuner's alike)."""
    owned = None
    if use_gpu:
        resources = context.resources()
        if resource_name in resources:
            owned = list(resources[resource_name].addresses)
    return layout.visible_devices(role, use_gpu=use_gpu, owned=owned, count=count,
                                  preset=os.environ.get("CUDA_VISIBLE_DEVICES"), resource_name=resource_name)


def result_chunks(rank: int, path: str) -> Iterator[tuple[int, int, bytes]]:
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


def arrow_rows(batches: Iterator[Any], rows: Callable[[], Iterator[tuple[int, int, bytes]]]) -> Iterator[Any]:
    """A `mapInArrow` task's body: drain the input (its rows only place one task per partition), then each of
    `rows()`'s `(rank, seq, chunk)` as a record batch of `ROWS` (a barrier task's and a search's tuner's)."""
    import pyarrow as pa

    for _ in batches:
        pass
    schema = pa.schema([("rank", pa.int32()), ("seq", pa.int32()), ("chunk", pa.binary())])
    for rank, seq, chunk in rows():
        yield pa.RecordBatch.from_pydict({"rank": [rank], "seq": [seq], "chunk": [chunk]}, schema=schema)


def arrow_partition_function(plan: TaskPlan):
    """The function for `DataFrame.mapInArrow(..., barrier=True)`: yields record batches of (rank, seq, chunk)."""

    def barrier_task(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import BarrierTaskContext

        yield from arrow_rows(batches, lambda: run_task(plan, BarrierTaskContext.get()))

    return barrier_task
