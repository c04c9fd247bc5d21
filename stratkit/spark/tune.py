"""A hyperparameter search on Spark: `SparkRunner(num_workers=N, tune=True).run(search_fn)`.

The driver side. `search_fn` is a function that builds a tuner and searches
(`stratkit.tune(keras_tuner.RandomSearch(...)).search(...)`, docs/tuning.md);
one `run()`:

1. checks what can be checked before Spark runs anything: the arguments (no
   DataFrame: every tuner needs all of its data; read it inside search_fn),
   the GPU confs with `use_gpu`, and that the cluster has N task slots at once
   (more tuners than slots, or than GPUs with spark.task.resource.gpu.amount,
   is a ConfigError: the tuners would wait for each other at the search's
   start);
2. hosts the search service here (`stratkit.tuning.driver.DriverSearch`), on
   the address the log server uses (spark.driver.bindAddress / host; the token
   guards it), and starts the log server;
3. runs one ordinary (non-barrier) Spark task per tuner
   (`stratkit.spark.tune_task`): a search uses whatever slots are free, where
   one barrier stage would wait for all of them;
4. judges each tuner's end as it is told (`DriverSearch.judge`): a tuner that
   dies before the search started (its script fails, its store is out of
   reach) stops the others and fails the run (`SparkTrainingError`, the
   launcher's root-cause report); one that dies later, or whose executor is
   lost, is a lease that expires: its trial runs again on another tuner (and
   Spark may run the task again: a new tuner joins), the run goes on. After
   the search ended, a tuner that does not exit (hung) is stopped;
5. returns the lowest tuner's return value; raises the search's own failure
   (a ConfigError every tuner saw) first.

Works over Spark Connect as `SparkRunner` does (the tasks then run
`mapInArrow`, the driver's services are this client's).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.process.payload import pickle_payload
from stratkit.spark import data as data_module
from stratkit.spark import slots
from stratkit.spark.confs import (STANDBY_CONF, check_ssl, choose_stage, conf_bool, read_confs, spark_context,
                                  task_gpu_amount)
from stratkit.spark.failures import AttemptState, SparkTrainingError, explain
from stratkit.spark.jobs import cancel, collect_rows, job_tag
from stratkit.spark.layout import TaskRole
from stratkit.spark.logserver import LogServer, TaskLog
from stratkit.spark.task import INFO_SEQ
from stratkit.spark.tune_task import TunerPlan, arrow_function, rdd_function
from stratkit.training.tracking import handoff
from stratkit.tuning import environment
from stratkit.tuning.driver import DriverSearch, lost_message
from stratkit.tuning.service import STOP_GRACE

log = status.logger(__name__)

ENGINE = "SparkRunner(tune=True)"


@dataclass
class SearchReport:
    """What happened in the last search (`runner.last_run`): for logs, tests and post-mortems."""

    run_id: str
    stage: str
    tuners: int
    seconds: float = 0.0
    succeeded: bool = False
    #: Each tuner's exit code as the driver heard it (None: its connection ended without one).
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    #: Tuners that died after the search started (their trials ran again elsewhere), in the order seen.
    lost: list[str] = field(default_factory=list)
    #: Each tuner's training process id (for checks that nothing is left running).
    pids: dict[str, int | None] = field(default_factory=dict)
    #: The search service's address on the driver.
    service: tuple[str, int] | None = None


def check_arguments(args: tuple, kwargs: dict) -> None:
    """A DataFrame argument is refused: `SparkRunner` stages it as one shard per worker, a tuner needs it all."""
    for name, value in [(f"args[{i}]", a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]:
        if isinstance(value, data_module.DataFrameInput) or type(value).__name__ == "DataFrame":
            raise ConfigError(f"argument {name} is a Spark DataFrame, but a search's tuners each train on all of "
                              "the data (SparkRunner(tune=True) does not shard it). Fix: pass numpy arrays, or "
                              "read the data inside the search function (e.g. from Parquet)")


def run_search(runner: Any, spark: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`runner.run(fn, ...)` for a `SparkRunner(tune=True)` on the SparkSession `spark` (see the module's
    docstring)."""
    called = time.monotonic()
    check_arguments(args, kwargs)
    sc = spark_context(spark)
    confs = read_confs(spark, sc)
    check_ssl(confs, ENGINE, log)
    gpu_count = _gpu_count(runner, confs)
    stage = choose_stage(confs, sc)
    n = runner.num_workers
    slots.check_slots(n, confs, sc, what=f"a search of {n} tuners", tasks="tuner tasks",
                      otherwise="the tuners that find no slot would start after the others, which wait for them "
                      "at the search's start")
    payload = pickle_payload(fn, args, kwargs, where="the Spark tasks")
    run_id = f"stratkit-{uuid.uuid4().hex[:12]}"
    report = SearchReport(run_id=run_id, stage=stage, tuners=n)
    runner.last_run = report
    driver_host = confs.get("spark.driver.host") or "127.0.0.1"
    bind_host = confs.get("spark.driver.bindAddress") or driver_host
    named = os.environ.get(environment.HOST_VAR, "").strip()  # the user's choice of the service's address
    search = _search(n, named or bind_host)
    report.service = search.address
    state = AttemptState()
    tag = f"{run_id}-search"
    server: LogServer | None = None

    def stop_everything(reason: str) -> None:
        assert server is not None
        server.abort_all(reason)

    def on_exit(task: TaskLog) -> None:
        verdict = search.judge(task.exit_code)
        if verdict == "ok":
            return
        with state.lock:
            if state.finished or state.timed_out or state.failure is not None:
                return
            if verdict == "lost":
                report.lost.append(task.label)
                how = "ended without an exit code (its executor is gone?)" if task.exit_code is None else \
                    f"exited with code {task.exit_code}"
                log.warning("%s", lost_message(task.label, how))
                return
            state.failure = task
        threading.Thread(target=stop_everything, name="stratkit-abort", daemon=True,
                         args=(f"{task.label} failed before the search started",)).start()

    server = _log_server(bind_host, on_exit, n)
    plan = TunerPlan(run_id=run_id, num_tasks=n, payload=payload, log_host=driver_host, log_port=server.port,
                     log_token=server.token,
                     service=(named or driver_host, search.address[1]),
                     token=search.token, engine=ENGINE, use_gpu=runner.use_gpu, gpu_count=gpu_count,
                     standby=conf_bool(confs, STANDBY_CONF, "true"), extra_env=tuple(handoff.hand_over().items()),
                     workdir=search.workdir)
    deadline = None if runner.timeout is None else called + runner.timeout
    watcher = threading.Thread(target=_watch, args=(search, server, state, deadline, spark, sc, tag),
                               name="stratkit-search-watch", daemon=True)
    log.info("%s: a search of %d tuner(s), the service at %s, via %s", run_id, n,
             environment.format_address(*search.address), stage)
    rows: list[tuple[int, int, bytes]] = []
    error: BaseException | None = None
    try:
        watcher.start()
        try:
            with job_tag(spark, sc, tag, f"stratkit search {run_id}"):
                rows = _collect(spark, sc, stage, plan)
        except KeyboardInterrupt:
            with state.lock:
                state.finished = True
            server.abort_all("the driver was interrupted")
            cancel(spark, sc, tag)
            raise
        except Exception as exc:  # noqa: BLE001 - Py4JJavaError, PySparkException, ... the job failed
            error = exc
        finally:
            with state.lock:
                state.finished = True
            server.shutdown()
        for task in server.tasks.values():
            report.exit_codes[task.label] = task.exit_code
        value = _finish(search, server, state, rows, error, report, runner.timeout)
        report.succeeded = True
        return value
    finally:
        search.close()
        report.seconds = time.monotonic() - called


def _gpu_count(runner: Any, confs: dict[str, str]) -> int | None:
    if not runner.use_gpu:
        return None
    key = "spark.task.resource.gpu.amount"
    amount = task_gpu_amount(confs, key)
    if runner.gpus_per_worker is not None and runner.gpus_per_worker > amount:
        raise ConfigError(f"gpus_per_worker={runner.gpus_per_worker} is more than the {amount} GPU(s) Spark gives "
                          f"each task ({key}={confs[key]}). Fix: raise {key} or lower gpus_per_worker")
    return runner.gpus_per_worker


def _search(tuners: int, host: str) -> DriverSearch:
    """The service on the driver at `host` (STRATKIT_TUNE_HOST, else the log server's address); every interface
    when this process cannot bind the log server's, as the log server does (the token guards both)."""
    try:
        return DriverSearch(tuners, engine=ENGINE, host=host)
    except ConfigError:
        if os.environ.get(environment.HOST_VAR, "").strip():
            raise
        return DriverSearch(tuners, engine=ENGINE, host="0.0.0.0")


def _log_server(bind_host: str, on_exit: Callable[[TaskLog], None], tuners: int) -> LogServer:
    try:
        return LogServer(bind_host, on_exit, max_tasks=tuners)
    except OSError:  # a bind address this process cannot use: every interface (the token still guards)
        return LogServer("", on_exit, max_tasks=tuners)


def _watch(search: DriverSearch, server: LogServer, state: AttemptState, deadline: float | None, spark: Any,
           sc: Any, tag: str) -> None:
    """Stop the tuners at the run's deadline, and those still running `STOP_GRACE` s after the searches ended and
    a tuner returned (a hung tuner: its lease expired and its trial ran elsewhere, but it never hears the end)."""
    ended_at = None
    while True:
        with state.lock:
            if state.finished:
                return
        now = time.monotonic()
        if deadline is not None and now > deadline:
            with state.lock:
                state.timed_out = True
            server.abort_all("the run's timeout passed")
            cancel(spark, sc, tag)
            return
        # A tuner that returned ran its script's last search: once every search that started ended too, the
        # others have STOP_GRACE s to return (between two searches of a script, none has returned yet).
        if search.ended and any(t.exit_code == 0 for t in server.tasks.values()):
            ended_at = ended_at or now
            if now - ended_at > STOP_GRACE:
                running = [t.label for t in server.tasks.values() if t.exit_code is None]
                log.warning("the search ended %g s ago and %s did not exit: stopped", STOP_GRACE,
                            ", ".join(running) or "a tuner")
                server.abort_all("the search ended; this tuner did not exit")
                ended_at = now  # (again after another grace, for a task that connects late)
        time.sleep(0.2)


def _collect(spark: Any, sc: Any, stage: str, plan: TunerPlan) -> list[tuple[int, int, bytes]]:
    """One non-barrier task per tuner: its rows (result chunks and its info row)."""
    return collect_rows(spark, sc, stage, plan.num_tasks, arrow_function(plan), rdd_function(plan), barrier=False)


def _finish(search: DriverSearch, server: LogServer, state: AttemptState, rows: list[tuple[int, int, bytes]],
            error: BaseException | None, report: SearchReport, timeout: float | None) -> Any:
    """The run's value, or its failure (the search's own first, then a tuner's, the timeout, Spark's)."""
    roles = [TaskRole(i, "tuner", i) for i in range(search.tuners)]
    search.check()
    if state.timed_out:
        raise SparkTrainingError(f"the search did not end within timeout={timeout}s; every tuner was stopped and "
                                 "the Spark job cancelled (the search's state is on its store: a new run resumes "
                                 "it)", timed_out=True, attempt=1)
    if state.failure is not None:
        raise explain(error or RuntimeError("a tuner failed"), state, server, roles, 1, 1, timeout)
    if error is not None:
        if search.ended:
            raise SparkTrainingError(f"the search ended (its results are on its store), but the Spark job failed, "
                                     f"so the tuners' return values are lost: {str(error).splitlines()[0]}",
                                     attempt=1) from None
        raise explain(error, state, server, roles, 1, 1, timeout)
    infos = {}
    chunks: dict[int, list[tuple[int, bytes]]] = {}
    for partition, seq, chunk in rows:
        if seq == INFO_SEQ:
            info = json.loads(chunk.decode())
            infos[partition] = info
            report.pids[f"tuner:{info['tuner']}"] = info.get("pid")
        else:
            chunks.setdefault(partition, []).append((seq, chunk))
    returned = {info["tuner"]: partition for partition, info in infos.items() if info["exit"] == 0}
    ended, partition = search.outcome(returned)
    if not ended or not returned:  # every tuner was lost: the searches' states are on their stores
        state.failure = next((t for t in server.tasks.values() if t.exit_code != 0), None)
        cause = explain(error or RuntimeError("every tuner was lost"), state, server, roles, 1, 1, timeout)
        raise SparkTrainingError(f"no tuner ran its search function to its end (each was lost: "
                                 f"{', '.join(report.lost) or 'none reported'}); a new run resumes the searches from "
                                 f"their stores. The first lost: {cause}", task=cause.task, rank=cause.rank,
                                 exit_code=cause.exit_code, lines=cause.lines, attempt=1)
    if partition is None or partition not in chunks:
        return None
    import cloudpickle

    return cloudpickle.loads(b"".join(chunk for _, chunk in sorted(chunks[partition])))


__all__ = ["ENGINE", "SearchReport", "check_arguments", "run_search"]
