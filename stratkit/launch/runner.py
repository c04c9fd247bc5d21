"""`LocalRunner`: `SparkRunner`'s and `RayRunner`'s `run(train_fn)` on this machine, for a script or a notebook.

    from stratkit import LocalRunner
    result = LocalRunner(num_workers=2).run(train_fn, epochs=3)   # SparkRunner / RayRunner: the same call

A thin front door on `stratkit launch`'s machinery, not a third copy of it:
one `run()` plans the tasks (`launch/plan.py`, checked by `stratkit.detect`),
holds their ports, starts one process per task in the launch's private
network (`launch/attempt.py`, `launch/supervisor.py` on the shared
`stratkit.process` layer), prints every line as `[worker:1] ...`, restarts the
whole cluster after a failure (`max_retries`; a preempted attempt, exit 75, is
not counted), and reports the first failure with `process/report`'s
root-cause report. What is its own: train_fn travels cloudpickled (by value
when it is defined in `__main__` or a notebook cell, as on Spark and Ray:
`process/payload.py`) to `python -m stratkit.launch.runfn` in each task, the
chief's return value comes back, a failure is a `LocalTrainingError`, and
`timeout` covers the whole run, retries included, as the cluster runners' does.

Imports no TensorFlow: only the task processes do.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stratkit.cluster import layout as cluster_layout
from stratkit.errors import ConfigError, StratkitError
from stratkit.launch.plan import LaunchPlan, plan_launch
from stratkit.launch.results import LaunchResult
from stratkit.launch.supervisor import Supervisor
from stratkit.launch.tune import TunePlan
from stratkit.process import arguments
from stratkit.process.payload import RESULT, TUNER_RESULT, pickle_payload
from stratkit.process.report import is_preempted
from stratkit.status import EXIT_PREEMPTED
from stratkit.strategy.server import RUN_DIR_VAR
from stratkit.training.tracking import handoff
from stratkit.tuning import environment as tune_env
from stratkit.tuning.hub import SearchHub
from stratkit.tuning.service import SearchService

#: Who reports in the root-cause report.
REPORT_TITLE = "stratkit local"
#: Set in every task's environment: the runner that started it (the MLflow logger's `engine` param reads it).
RUNNER_VAR = "STRATKIT_RUNNER"
#: How the runner's arguments are written in layout messages.
ARGUMENTS = cluster_layout.Spelling(workers="num_workers", ps="num_ps")
_FIX = "do not set STRATKIT_STRATEGY or STRATKIT_CLUSTER_ENV for LocalRunner: it decides them"


class LocalTrainingError(StratkitError, RuntimeError):
    """Training on local workers failed: which task, how it ended, its last output lines.

    Attributes:
        task: the failing task ("worker:1"), None when the run was stopped from outside.
        exit_code: its exit code (negative: the signal that killed it), or None (it still ran at the timeout).
        lines: its last output lines (`stratkit.process.pump.TAIL_LINES`).
        attempt: the attempt that failed (1-based).
        timed_out: True when `timeout` ended the run.
        report: the root-cause report (also in the message).
    """

    def __init__(self, message: str, *, task: str | None = None, exit_code: int | None = None,
                 lines: tuple[str, ...] = (), attempt: int | None = None, timed_out: bool = False,
                 report: str = "") -> None:
        super().__init__(message)
        self.task = task
        self.exit_code = exit_code
        self.lines = list(lines)
        self.attempt = attempt
        self.timed_out = timed_out
        self.report = report

    @property
    def preempted(self) -> bool:
        """Every task stopped on a preemption notice at one step and wrote its backup: `run` again resumes there."""
        return is_preempted(self.exit_code)


@dataclass
class LocalRunReport:
    """What happened in the last `run()` (`runner.last_run`): for logs, tests and post-mortems."""

    run_id: str
    tasks: list[str]
    attempts: int = 0
    #: Attempts that ended on a preemption notice (exit 75 after the backup): restarted without counting.
    preempted: int = 0
    seconds: float = 0.0
    succeeded: bool = False
    #: The last attempt's tasks: exit codes and process ids.
    exit_codes: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)


class LocalRunner:
    """Run `train_fn` as a TensorFlow cluster of local processes; return the chief's result.

    The same `run(train_fn, *args, **kwargs)` as `stratkit.spark.SparkRunner` and
    `stratkit.ray.RayRunner`: a function that trains here moves to Spark or Ray by
    changing the runner's name.

    Args:
        num_workers: training processes. Without `num_ps` they form a MultiWorkerMirroredStrategy
            cluster of `num_workers` "worker" tasks (worker 0 is the chief). With `num_ps`, a
            parameter-server cluster of one "chief" (the coordinator), `num_workers` "worker" and
            `num_ps` "ps" tasks.
        num_ps: parameter-server tasks (0: synchronous multi-worker training).
        use_gpu: give the training tasks this machine's GPUs, split evenly (or `gpus_per_worker`
            each); False hides every GPU (CUDA_VISIBLE_DEVICES="").
        gpus_per_worker: GPUs per training task (needs use_gpu=True).
        max_retries: restart the whole cluster this many times after a failure; a train_fn using
            `trainer.fit(backup_dir=...)` resumes. A preempted attempt (every task stopped on a
            notice at one step, wrote its backup and exited 75) restarts without counting.
        timeout: seconds for the whole `run()`, retries included; then every task is stopped and
            `LocalTrainingError` raised.
        private_network: run the tasks in a private, loopback-only network (their TensorFlow servers
            listen on every interface, unauthenticated): None (default) where this machine allows it,
            else a warning; True: always, else ConfigError; False: never (with the warning). An MLflow
            tracking server on this machine's loopback stays reachable from it (`stratkit.tracking`).
        log_dir: also write each task's output to `log_dir/<role>-<index>.log`, with events.jsonl.
        env: the tasks' base environment (default: this process's).
        tune: a hyperparameter search (docs/tuning.md): the `num_workers` tasks are tuners of one search
            (train_fn wraps its tuner in `stratkit.tune(...)`), this process runs the search service
            (loopback, the run's token; it imports the tuner library when the first tuner registers); no
            TF_CONFIG, no private network (no TensorFlow server listens); a tuner that dies once the search
            started loses its trial to another tuner and the run goes on. `run` returns tuner 0's value
            (the lowest surviving tuner's).

    Inside train_fn, `stratkit.detect()` / `stratkit.Trainer()` see the cluster (TF_CONFIG,
    `spec.source == "launch"`); train_fn runs in a fresh Python process per task, in this
    process's working directory, so it must import what it uses and create the strategy before
    any other TensorFlow op.
    """

    def __init__(self, num_workers: int = 2, *, num_ps: int = 0, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, max_retries: int = 0, timeout: float | None = None,
                 private_network: bool | None = None, log_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, tune: bool = False) -> None:
        arguments.positive_int("num_workers", num_workers)
        arguments.positive_int("num_ps", num_ps, minimum=0, example="1")
        self.tasks = cluster_layout.plan_tasks(num_workers, chief=num_ps > 0, ps=num_ps, spelling=ARGUMENTS)
        cluster_layout.check_plan(self.tasks, launcher="launch", fix=_FIX, allow_preset=False)
        arguments.check_gpus(use_gpu, gpus_per_worker)
        arguments.positive_int("max_retries", max_retries, minimum=0, example="1")
        self.timeout = arguments.check_timeout(timeout)
        if private_network is not None and not isinstance(private_network, bool):
            raise ConfigError(f"private_network must be None, True or False: got {private_network!r}")
        if tune and num_ps:
            raise ConfigError(f"num_ps={num_ps} does not go with tune=True: a search's tuners each train their trials "
                              "alone. Fix: drop num_ps")
        if tune and private_network:
            raise ConfigError("private_network=True does not go with tune=True: the tuners reach this process's "
                              "search service on loopback, and no TensorFlow server listens. Fix: drop private_network")
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker
        self.max_retries = max_retries
        self.private_network = private_network
        self.log_dir = log_dir
        self.env = None if env is None else dict(env)
        self.tune = bool(tune)
        self.last_run: LocalRunReport | None = None

    def run(self, train_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `train_fn(*args, **kwargs)` in every task; return the chief's return value.

        Raises:
            ConfigError: the cluster or the arguments cannot work (before any process starts).
            LocalTrainingError: a task failed (after all retries), `timeout` passed, or the run was
                stopped by SIGTERM (its `preempted` is True when every task saved its backup).
            KeyboardInterrupt: Ctrl-C (a notebook's interrupt): every task was stopped first.
        """
        if not callable(train_fn):
            raise ConfigError(f"train_fn must be a function: got {type(train_fn).__name__}. "
                              "Fix: runner.run(train_fn, *args, **kwargs)")
        payload = pickle_payload(train_fn, args, kwargs, where="the local training processes")
        report = LocalRunReport(run_id=f"stratkit-{uuid.uuid4().hex[:12]}", tasks=[t.name for t in self.tasks])
        self.last_run = report
        started = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="stratkit-local-")  # 0700: the payload and the chief's result
        try:
            with open(os.path.join(workdir, "payload.pkl"), "wb") as handle:
                handle.write(payload)
            service = self._search_service(workdir) if self.tune else None
            try:
                plan = self._plan(workdir, service)
                result = Supervisor(plan).run()
            finally:
                if service is not None:
                    service[0].close()
            self._record(report, result)
            if result.ok:
                report.succeeded = True
                return _load_result(workdir, len(self.tasks) if self.tune else 0)
            raise _failure(result, plan, self.max_retries + 1 + report.preempted)
        finally:
            report.seconds = time.monotonic() - started
            shutil.rmtree(workdir, ignore_errors=True)

    # -- steps ----------------------------------------------------------------------------------
    def _search_service(self, workdir: str) -> tuple[SearchHub, str]:
        """A tune run's searches, served here on the driver (each search's store and planner come with its first
        tuner's registration)."""
        env = os.environ if self.env is None else self.env
        lease = tune_env.seconds(tune_env.LEASE_VAR, tune_env.LEASE_SECONDS, env)
        start = tune_env.seconds(tune_env.START_VAR, tune_env.START_SECONDS, env)
        markers = os.path.join(workdir, "tune")
        token = tune_env.new_token()
        hub = SearchHub(tune_env.DEFAULT_HOST, 0, token, tuners=self.num_workers,
                        create=lambda search: SearchService(None, tuners=self.num_workers, lease_seconds=lease,
                                                            start_seconds=start, markers=markers, search=search))
        return hub, token

    def _plan(self, workdir: str, service: tuple[SearchHub, str] | None = None) -> LaunchPlan:
        env = dict(os.environ if self.env is None else self.env)
        env.update(handoff.hand_over(env))  # the driver's MLflow run, continued by the chief (stratkit.tracking)
        env[RUNNER_VAR] = "local"
        env[RUN_DIR_VAR] = os.path.join(workdir, "markers")  # the parameter-server done markers, private
        if not self.use_gpu:
            gpus_per_worker: int | None = 0
        else:
            gpus_per_worker = self.gpus_per_worker
        tune = None
        if service is not None:
            tune = TunePlan(service[1], "LocalRunner(tune=True)", os.path.join(workdir, "tune"), host_task=None,
                            address=service[0].address)
        plan = plan_launch([sys.executable, "-m", "stratkit.launch.runfn", workdir], workers=self.num_workers,
                           chief=self.num_ps > 0, ps=self.num_ps, evaluator=False, max_restarts=self.max_retries,
                           log_dir=self.log_dir, host="127.0.0.1", base_port=None, timeout=None,
                           exit_grace=30.0, stop_grace=10.0, env=env, stdout=None, stderr=None,
                           handle_signals=True, private_network=self.private_network,
                           gpus_per_worker=gpus_per_worker, gpus_per_ps=None if self.use_gpu else 0, tune=tune)
        return dataclasses.replace(plan, report_title=REPORT_TITLE, timeout_setting="timeout=", print_report=False,
                                   run_timeout=self.timeout)

    @staticmethod
    def _record(report: LocalRunReport, result: LaunchResult) -> None:
        report.attempts = len(result.attempts)
        report.preempted = sum(a.outcome == "preempted" for a in result.attempts)
        if result.attempts:
            for task in result.attempts[-1].tasks:
                report.exit_codes[task.task] = task.returncode
                report.pids[task.task] = task.pid


def _load_result(workdir: str, tuners: int = 0) -> Any:
    """The chief's value; a tune run's: the lowest tuner's that finished (`payload.TUNER_RESULT`)."""
    names = [TUNER_RESULT.format(i) for i in range(tuners)] if tuners else [RESULT]
    path = next((os.path.join(workdir, n) for n in names if os.path.exists(os.path.join(workdir, n))), None)
    if path is None:
        return None
    import cloudpickle

    with open(path, "rb") as handle:
        return cloudpickle.load(handle)


def _failure(result: LaunchResult, plan: LaunchPlan, attempts: int) -> BaseException:
    """The run's end as an exception: KeyboardInterrupt for Ctrl-C, else a LocalTrainingError with the report."""
    if result.interrupted_by == signal.SIGINT:
        return KeyboardInterrupt()
    if result.interrupted_by is not None:
        name = signal.Signals(result.interrupted_by).name
        if result.returncode == EXIT_PREEMPTED:
            return LocalTrainingError(f"{name} reached this process: every task stopped at the same step, wrote "
                                      f"its backup and exited {EXIT_PREEMPTED}; run() again resumes there",
                                      exit_code=EXIT_PREEMPTED, attempt=len(result.attempts))
        return LocalTrainingError(f"{name} reached this process: every task was stopped",
                                  attempt=len(result.attempts))
    attempt = result.attempts[-1]
    failure = attempt.failure
    assert failure is not None
    which = f"attempt {attempt.number + 1} of {attempts}"
    if attempt.outcome == "timed_out":
        summary = f"training did not finish within timeout={plan.run_timeout}s ({which}); every task was stopped."
    else:
        summary = f"task {failure.task} {failure.reason} ({which}); the other tasks were stopped."
    return LocalTrainingError(f"{summary}\n{result.report}", task=failure.task, exit_code=failure.returncode,
                              lines=failure.last_lines, attempt=attempt.number + 1,
                              timed_out=attempt.outcome == "timed_out", report=result.report)
