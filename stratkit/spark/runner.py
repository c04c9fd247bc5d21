"""`SparkRunner`: run one training function as a TensorFlow cluster on Spark executors.

The driver side of the Spark adapter. One `run()`:
  1. checks everything that can be checked before Spark is involved: the
     layout (through `stratkit.detect`), GPU confs, encryption, and whether
     the cluster has enough task slots for the barrier stage;
  2. plans table arguments for reading in place, stages the DataFrames Spark
     computes as Parquet (`stratkit.spark.in_place` decides which);
  3. starts the log server, then one barrier stage with one task per TF task
     (`DataFrame.mapInArrow(..., barrier=True)`, or an RDD barrier stage where
     that is unavailable) -- each task runs `stratkit.spark.task.run_task`;
  4. returns the chief's (rank 0's) return value; or raises
     `SparkTrainingError` -- a summary line, then the root-cause report in the
     launcher's format (`stratkit.spark.failures`) -- after stopping every
     other task; `max_retries` re-runs the whole stage.

Size: over 400 lines because `SparkRunner.run`'s attempt loop and the few
steps only it calls (stage, collect, result) read best together; the confs
are in `spark/confs.py`, the failure wording in `spark/failures.py`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stratkit import status
from stratkit.data import TableInput
from stratkit.errors import ConfigError
from stratkit.process import arguments
from stratkit.process.payload import pickle_payload
from stratkit.process.report import PREEMPTED_GRACE, is_preempted
from stratkit.process.pump import prefixed
from stratkit.spark import data as data_module
from stratkit.spark import elastic, in_place, layout, slots, staging
from stratkit.spark import tune as tune_module
from stratkit.spark.layout import TaskRole
from stratkit.spark.jobs import cancel, collect_rows, job_tag
from stratkit.spark.confs import (
    STANDBY_CONF,
    check_ssl,
    choose_stage,
    conf_bool,
    read_confs,
    spark_context,
    task_gpu_amount,
)
from stratkit.spark.failures import AttemptState, SparkTrainingError, explain, first_line
from stratkit.spark.logserver import LogServer, TaskLog
from stratkit.spark.rendezvous import Rendezvous
from stratkit.spark.task import (
    INFO_SEQ,
    TaskPlan,
    arrow_partition_function,
    rdd_partition_function,
)
from stratkit.training.tracking import handoff

log = status.logger(__name__)


@dataclass
class RunReport:
    """What happened in the last `run()` (`runner.last_run`): for logs, tests and post-mortems."""

    run_id: str
    stage: str
    tasks: list[str]
    attempts: int = 0
    #: Attempts that ended on a preemption notice (every task saved at one step and exited 75): retried without
    #: counting against max_retries.
    preempted: int = 0
    seconds: float = 0.0
    succeeded: bool = False
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    tails: dict[str, list[str]] = field(default_factory=dict)
    first_output_seconds: dict[str, float] = field(default_factory=dict)
    #: Per-phase timeline of the run: `{"who": "driver" or a task label, "event": ..., "t": time.time(),
    #: "s": seconds since run() was called}`, in time order. Task phases come from the last attempt's
    #: successful tasks (slot check, stage submit, task start, process spawned, strategy ready -- every
    #: worker connected --, first step, end of training, process exit, run() returns).
    timeline: list[dict[str, Any]] = field(default_factory=list)
    called_at: float = 0.0
    #: Each task's training process id (for checks that nothing is left running).
    pids: dict[str, int | None] = field(default_factory=dict)

    def mark(self, who: str, event: str, when: float | None = None) -> None:
        t = time.time() if when is None else when
        self.timeline.append({"who": who, "event": event, "t": t, "s": round(t - self.called_at, 4)})

    def format_timeline(self) -> str:
        """The timeline as aligned text lines (what run() logs at debug level)."""
        return "\n".join(f"{e['s']:8.3f}s  {e['who']:<10} {e['event']}"
                         for e in sorted(self.timeline, key=lambda e: e["t"]))


class SparkRunner:
    """Run `train_fn` on Spark executors as a TensorFlow cluster; return the chief's result on the driver.

    Args:
        num_workers: training tasks. Without `num_ps` they form a
            MultiWorkerMirroredStrategy cluster of `num_workers` "worker" tasks
            (worker 0 is the chief). With `num_ps`, a parameter-server cluster of
            one "chief" (the coordinator), `num_workers` "worker" and `num_ps`
            "ps" tasks. Each task is one Spark barrier task.
        use_gpu: give each task the GPUs Spark scheduled for it (needs
            spark.task.resource.gpu.amount and GPU discovery on the executors);
            False hides all GPUs (CUDA_VISIBLE_DEVICES="").
        gpus_per_worker: use only this many of each task's Spark GPUs (default: all).
        num_ps: parameter-server tasks (0: synchronous multi-worker training).
        spark: the SparkSession (default: the active one, else a new one).
        max_retries: re-run the whole barrier stage this many times after a
            failure (train_fn using `trainer.fit(backup_dir=...)` resumes). An
            attempt that was preempted (its tasks stopped on a preemption notice
            at one step, wrote their backups and exited 75) is re-run without
            counting: it resumes at that step.
        min_workers: elastic retries (no `num_ps`): a retry runs with the slots
            Spark has then, from `min_workers` to `num_workers` tasks (fewer once
            an executor's host is gone); `Trainer` keeps the global batch, so with
            backup_dir the run is one process's (`stratkit.spark.elastic`).
        timeout: seconds for the whole `run()`, retries included; then every
            task is killed, the Spark job cancelled and SparkTrainingError raised.
        tune: a hyperparameter search (docs/tuning.md): `run(search_fn)` runs `num_workers` tuners of one
            search (search_fn wraps its tuner in `stratkit.tune(...)`) as ordinary Spark tasks, one per free
            slot (per GPU with use_gpu), with the search service on this driver; no TF_CONFIG; a tuner lost
            after the search started (its process, its executor) is a lease that expires, its trial runs
            again on another tuner. `run` returns the lowest tuner's value (`stratkit.spark.tune`).

    Inside train_fn, `stratkit.detect()` / `stratkit.Trainer()` see the cluster
    (TF_CONFIG, `spec.source == "spark"`); train_fn runs in a fresh Python
    process, so it must import what it uses and create the strategy before any
    other TensorFlow op. A run called inside `with mlflow.start_run():` hands that
    run to the tasks: `stratkit.callbacks.MLflowLogger` on the chief logs into it.
    """

    def __init__(self, num_workers: int = 2, *, use_gpu: bool = False, gpus_per_worker: int | None = None,
                 num_ps: int = 0, spark: Any = None, max_retries: int = 0, timeout: float | None = None,
                 min_workers: int | None = None, tune: bool = False) -> None:
        self.tune = arguments.check_tune(tune, num_ps=num_ps, min_workers=min_workers, max_retries=max_retries)
        self.roles: list[TaskRole] = layout.plan_roles(num_workers, num_ps)
        self.min_workers = arguments.check_min_workers(min_workers, num_workers, num_ps)
        layout.check_layout(self.roles)
        arguments.check_gpus(use_gpu, gpus_per_worker)
        arguments.positive_int("max_retries", max_retries, minimum=0, example="1")
        arguments.check_timeout(timeout)
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker
        self.max_retries = max_retries
        self.timeout = timeout
        self._spark = spark
        self.last_run: RunReport | tune_module.SearchReport | None = None
        # Set by MirroredStrategyRunner: GPU counts per rank, the resource name, and the strategy wrap.
        self._gpu_counts: list[int | None] | None = None
        self._gpu_resource_name = "gpu"
        self._wrap: str | None = None
        # The API the user called (MirroredStrategyRunner sets its own), for messages, and its logger.
        self._api_name = type(self).__name__
        self._log = log

    @property
    def num_tasks(self) -> int:
        """Barrier tasks (= TF tasks) one run uses."""
        return len(self.roles)

    # -- public ---------------------------------------------------------------------------------
    def run(self, train_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `train_fn(*args, **kwargs)` on every task; return the chief's (rank 0's) return value.

        Arguments are cloudpickled to the tasks. A `stratkit.data.TableInput`
        is planned once here and read in place by each worker's `Trainer.fit`
        (no copy). A Spark DataFrame argument (or `DataFrameInput(df,
        feature_cols=..., label_col=...)`) that is a plain scan of a Parquet
        table is read in place the same way (train_fn receives a `TableInput`);
        any other is staged as Parquet and arrives in train_fn as that
        worker's `ParquetShard` (`stratkit.spark.in_place` decides).
        Each task's output is printed on the driver, prefixed `[worker:1]`.

        Raises:
            ConfigError: the cluster or arguments cannot work (before any job runs).
            SparkTrainingError: a task failed (after all retries) or `timeout` passed.
        """
        if not callable(train_fn):
            raise ConfigError(f"train_fn must be a function: got {type(train_fn).__name__}. "
                              "Fix: runner.run(train_fn, *args, **kwargs)")
        if self.tune:
            return tune_module.run_search(self, self._session(), train_fn, args, kwargs)
        called_at = time.time()
        spark = self._session()
        sc = spark_context(spark)
        confs = read_confs(spark, sc)
        check_ssl(confs, self._api_name, self._log)
        gpu_counts = self._check_gpus(confs)
        stage = choose_stage(confs, sc)
        run_id = f"stratkit-{uuid.uuid4().hex[:12]}"
        report = RunReport(run_id=run_id, stage=stage, tasks=[r.label for r in self.roles], called_at=called_at)
        report.mark("driver", "run() called", called_at)
        self.last_run = report
        started = time.monotonic()
        slots.check_slots(self.num_tasks, confs, sc)
        report.mark("driver", "slots checked")
        staged: list[data_module.StagedData] = []
        try:
            args, kwargs = self._stage_data(spark, run_id, args, kwargs, staged)
            if staged and self.min_workers is not None and self.min_workers < self.num_workers:
                raise ConfigError(f"min_workers={self.min_workers} with a DataFrame argument: its Parquet shards are "
                                  f"cut for {self.num_workers} workers, and a smaller retry would skip some. Fix: "
                                  "read the data inside train_fn (or pass numpy arrays), or drop min_workers")
            # Inside the task closure, which Spark broadcasts once per stage (not once per task).
            payload = pickle_payload(train_fn, args, kwargs, where="the Spark tasks")
            driver_host = confs.get("spark.driver.host") or "127.0.0.1"
            bind_host = confs.get("spark.driver.bindAddress") or driver_host
            deadline = None if self.timeout is None else started + self.timeout
            roles = self.roles
            failures = 0
            while True:
                report.attempts += 1
                attempt = report.attempts
                plan = TaskPlan(run_id=run_id, attempt=attempt, roles=tuple(roles), payload=payload,
                                log_host=driver_host, log_port=0, log_token="", use_gpu=self.use_gpu,
                                gpu_counts=tuple(gpu_counts[:len(roles)]), gpu_resource_name=self._gpu_resource_name,
                                wrap=self._wrap, standby=conf_bool(confs, STANDBY_CONF, "true"),
                                extra_env=tuple(handoff.hand_over().items()))
                try:
                    result = self._attempt(spark, sc, stage, plan, bind_host, deadline, report,
                                           attempts=self.max_retries + 1 + report.preempted)
                except SparkTrainingError as error:
                    if error.timed_out:
                        raise
                    if error.preempted:
                        # Not a failure: every task saved at one step (Spark does not count a task lost with a
                        # decommissioned executor against spark.task.maxFailures either).
                        report.preempted += 1
                        log.warning("attempt %d was preempted (%s); re-running the whole barrier stage, which "
                                    "resumes at the step of its preemption backup (a preemption is not counted "
                                    "against max_retries: %d of %d retries left)", attempt, first_line(error),
                                    self.max_retries - failures, self.max_retries)
                    else:
                        failures += 1
                        if failures > self.max_retries:
                            raise
                        log.info("attempt %d of %d failed (%s); re-running the whole barrier stage", attempt,
                                 self.max_retries + 1 + report.preempted, first_line(error))
                    if self.min_workers is not None:
                        workers = elastic.workers_for_retry(self.num_workers, self.min_workers, sc)
                        if workers is None:  # below min_workers: the failure as it was, not retried
                            log.warning("fewer than min_workers=%d task slots are left: not retried",
                                        self.min_workers)
                            raise
                        if workers != len(roles):
                            log.warning("world size %d -> %d: the retry runs with the slots Spark has "
                                        "(min_workers=%d, num_workers=%d)", len(roles), workers, self.min_workers,
                                        self.num_workers)
                        roles = layout.plan_roles(workers)
                    continue
                report.succeeded = True
                return result
        finally:
            for item in staged:
                staging.remove(item)
            report.seconds = time.monotonic() - started
            report.mark("driver", "run() returns")
            report.timeline.sort(key=lambda e: e["t"])
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s timeline:\n%s", run_id, report.format_timeline())

    # -- steps ----------------------------------------------------------------------------------
    def _session(self) -> Any:
        if self._spark is not None:
            return self._spark
        from pyspark.sql import SparkSession

        return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()

    def _check_gpus(self, confs: dict[str, str]) -> list[int | None]:
        if self._gpu_counts is not None:
            return list(self._gpu_counts)
        if not self.use_gpu:
            return [None] * self.num_tasks
        key = f"spark.task.resource.{self._gpu_resource_name}.amount"
        amount = task_gpu_amount(confs, key)
        if self.gpus_per_worker is not None and self.gpus_per_worker > amount:
            raise ConfigError(f"gpus_per_worker={self.gpus_per_worker} is more than the {amount} GPU(s) Spark gives "
                              f"each task ({key}={confs[key]}). Fix: raise {key} or lower gpus_per_worker")
        return [self.gpus_per_worker] * self.num_tasks

    def _stage_data(self, spark: Any, run_id: str, args: tuple, kwargs: dict,
                    staged: list[data_module.StagedData]) -> tuple[tuple, dict]:
        def convert(name: str, value: Any) -> Any:
            data = value if isinstance(value, TableInput) else _as_dataframe_input(value)
            if data is None:
                return value
            if self.num_ps:
                raise ConfigError(f"argument {name!r} is a {type(data).__name__}, but table and DataFrame input "
                                  f"is not supported with num_ps={self.num_ps} (parameter-server workers read data "
                                  "through the coordinator's dataset_fn). Fix: train synchronously (num_ps=0), or "
                                  "read the data inside train_fn")
            table = in_place.read_in_place(data, spark, name)
            if table is not None:   # every worker reads the table from its store: nothing staged
                return table
            item = staging.stage(data, spark, run_id, name, num_shards=sum(r.trains for r in self.roles))
            staged.append(item)
            return item

        new_args = tuple(convert(f"arg{i}", a) for i, a in enumerate(args))
        new_kwargs = {k: convert(k, v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _attempt(self, spark: Any, sc: Any, stage: str, plan: TaskPlan, bind_host: str,
                 deadline: float | None, report: RunReport, attempts: int) -> Any:
        """One barrier stage. Returns the chief's value or raises SparkTrainingError."""
        tag = f"{plan.run_id}-attempt{plan.attempt}"
        state = AttemptState()

        def stop_everything(reason: str, preempted: bool = False) -> None:
            if preempted:  # the others stop at the same step: they write their backups and exit 75 first
                server.wait_for_exits(PREEMPTED_GRACE, until=lambda: state.finished)
            server.abort_all(reason)
            cancel(spark, sc, tag)

        def on_exit(task: TaskLog) -> None:
            if task.exit_code == 0:
                return
            with state.lock:
                if state.failure is not None or state.timed_out or state.finished:
                    return
                state.failure = task
            threading.Thread(target=stop_everything, name="stratkit-abort", daemon=True,
                             args=(f"{task.label} failed with exit code {task.exit_code}",
                                   is_preempted(task.exit_code))).start()

        def on_timeout() -> None:
            with state.lock:
                if state.finished or state.failure is not None:
                    return
                state.timed_out = True
            stop_everything(f"timeout of {self.timeout}s reached")

        def on_fatal(message: str) -> None:  # the log server cannot accept tasks any more: fail, do not wait
            with state.lock:
                if state.failure is not None or state.timed_out or state.finished:
                    return
                state.server_failure = message
            threading.Thread(target=stop_everything, name="stratkit-abort", daemon=True, args=(message,)).start()

        limits = {"on_exit": on_exit, "on_fatal": on_fatal, "max_tasks": plan.num_tasks}
        try:
            server = LogServer(bind_host, **limits)
        except OSError:  # a bind address this process cannot use: every interface (the token still guards)
            server = LogServer("", **limits)
        exchange = Rendezvous(server.host or "", plan.num_tasks)
        plan = _with_log_server(plan, server, exchange)
        timer = None
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), on_timeout)
            timer.daemon = True
            timer.start()
        log.info("%s: attempt %d, %d barrier task(s) (%s) via %s", plan.run_id, plan.attempt, plan.num_tasks,
                 ", ".join(r.label for r in plan.roles), stage)
        started = time.time()
        error: BaseException | None = None
        rows: list[tuple[int, int, bytes]] = []
        report.mark("driver", f"stage submitted (attempt {plan.attempt})")
        try:
            with job_tag(spark, sc, tag, f"stratkit training {plan.run_id} attempt {plan.attempt}"):
                rows = _collect(spark, sc, stage, plan)
        except KeyboardInterrupt:
            with state.lock:
                state.finished = True
            stop_everything("the driver was interrupted")
            raise
        except Exception as exc:  # noqa: BLE001 - Py4JJavaError, PySparkException, ... all mean the stage failed
            error = exc
        finally:
            if timer is not None:
                timer.cancel()
            exchange.close()
            if error is not None:
                # A task whose Python worker was told to go (its executor stopping) passed the notice on: its
                # training process saves at the next step and exits 75; killing it now would lose that backup.
                server.wait_for_exits(PREEMPTED_GRACE, noticed=True)
                server.abort_all("the barrier stage failed")
            server.shutdown()
            with state.lock:
                state.finished = True
            for task in server.tasks.values():
                report.exit_codes[task.label] = task.exit_code
                report.tails[task.label] = list(task.tail)
                if task.first_line_at is not None:
                    report.first_output_seconds[task.label] = task.first_line_at - started
        report.mark("driver", "stage finished" if error is None else "stage failed")
        if error is None:
            _take_task_info(rows, report, server)
            return _assemble_result(rows)
        raise explain(error, state, server, list(plan.roles), plan.attempt, attempts, self.timeout) from None


# -- helpers ------------------------------------------------------------------------------------

def _as_dataframe_input(value: Any) -> data_module.DataFrameInput | None:
    if isinstance(value, data_module.DataFrameInput):
        return value
    if type(value).__name__ != "DataFrame":  # cheap test first: never import pyspark.sql for plain arguments
        return None
    from pyspark.sql import DataFrame

    return data_module.DataFrameInput(value) if isinstance(value, DataFrame) else None


def _with_log_server(plan: TaskPlan, server: LogServer, exchange: Rendezvous) -> TaskPlan:
    """The plan with this attempt's driver endpoints (the tasks reach both at plan.log_host)."""
    return replace(plan, log_port=server.port, log_token=server.token, rendezvous_port=exchange.port,
                   rendezvous_token=exchange.token)


def _collect(spark: Any, sc: Any, stage: str, plan: TaskPlan) -> list[tuple[int, int, bytes]]:
    return collect_rows(spark, sc, stage, plan.num_tasks, arrow_partition_function(plan), rdd_partition_function(plan),
                        barrier=True)


def _take_task_info(rows: list[tuple[int, int, bytes]], report: RunReport, server: LogServer) -> None:
    """Add every task's own timeline (its info row) to the report; print output the driver did not see live."""
    import json

    for rank, seq, chunk in sorted(rows, key=lambda row: row[0]):
        if seq != INFO_SEQ:
            continue
        info = json.loads(chunk.decode())
        label = info.get("label", f"rank {rank}")
        for event in info.get("events", []):
            report.mark(label, event["event"], event["t"])
        report.pids[label] = info.get("pid")
        if "tail" in info:
            report.tails[label] = list(info["tail"])
            _print_undelivered(label, info["tail"], server, info.get("log_error"))


def _print_undelivered(label: str, lines: Sequence[str], server: LogServer, why: str | None = None) -> None:
    """A task's last lines that its log connection did not deliver (the executors could not reach the driver)."""
    task = next((t for t in server.tasks.values() if t.label == label), None)
    seen = set(task.tail) if task is not None else set()
    missing = [text for text in lines if text not in seen]
    if not missing:
        return
    log.info("%s's output did not reach the driver live (%s); its last %d lines:", label,
             why or "its log server was unreachable", len(missing))
    for text in missing:  # the task's own lines, prefixed as the log server prints them live
        print(prefixed(label, text), file=sys.stdout, flush=True)


def _assemble_result(rows: list[tuple[int, int, bytes]]) -> Any:
    chunks = sorted((seq, chunk) for rank, seq, chunk in rows if rank == 0 and seq != INFO_SEQ)
    if not chunks:
        return None
    import cloudpickle

    return cloudpickle.loads(b"".join(chunk for _, chunk in chunks))
