"""One tuner of a search on Spark: an ordinary (non-barrier) task that runs the user's search function.

`SparkRunner(num_workers=N, tune=True).run(fn)` (`stratkit.spark.tune`) runs
one such task per tuner; Spark schedules each on a free executor slot (one per
GPU with spark.task.resource.gpu.amount), so no task waits for the others, as
a barrier stage's would. Each task:

1. takes the Python worker's warm standby (`stratkit.spark.task.standby_for`:
   TensorFlow and Keras already imported), connects to the driver's log server
   (its lines on the driver as `[tuner:1] ...`, its exit code, the driver's ABORT);
2. has the standby fork the tuner's training process with this tuner's part
   of the search (`stratkit.tuning.environment.task_env`: the driver's search
   service, its token, this tuner's id) and no TF_CONFIG: the process trains
   its trials alone on this task's devices (its Spark GPUs, else none);
3. yields its result (the function's return value, pickled) and one info row
   (tuner id, exit code), and never fails the Spark task for its process's
   exit: a tuner that dies after the search started is a lease that expires
   on the driver (its trial runs again on another tuner), and a failed Spark
   task would make Spark stop the other tuners with it. The driver judges
   every exit (`stratkit.tuning.driver.DriverSearch.judge`).

The tuner's id is the partition plus N times Spark's attempt number: a task
Spark runs again (its executor was lost) is a new tuner, which never takes
over a lease its predecessor may still hold.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stratkit import status
from stratkit.process.children import passing_on_notices
from stratkit.process.report import signal_name
from stratkit.spark import child as child_module
from stratkit.spark.layout import TaskRole
from stratkit.spark.logprotocol import SETUP_FAILED, LogClient
from stratkit.spark.task import (INFO_SEQ, LOG_CONNECT_SECONDS, NOTICES, arrow_rows, context_devices, keep_or_close,
                                 result_chunks, standby_for, task_workdir)
from stratkit.tuning import environment

#: Variables of the executor's environment a tuner must not inherit (the search's own come from the plan).
_DROPPED = ("TF_CONFIG", environment.ADDRESS_VAR, environment.TUNE_TOKEN_VAR, environment.TUNER_VAR,
            environment.TUNERS_VAR, environment.SERVE_VAR, environment.MARKERS_VAR, environment.GROUP_VAR)


@dataclass(frozen=True)
class TunerPlan:
    """What every tuner task needs, pickled into the Spark closure by the driver."""

    run_id: str
    num_tasks: int
    payload: bytes  # cloudpickled (fn, args, kwargs)
    log_host: str
    log_port: int
    log_token: str
    service: tuple[str, int]  # the driver's search service, as the executors dial it
    token: str  # the search's token
    engine: str
    use_gpu: bool
    gpu_count: int | None = None  # None: every GPU Spark gave the task
    gpu_resource_name: str = "gpu"
    preload: bool = True
    standby: bool = True
    extra_env: tuple[tuple[str, str], ...] = ()  # the driver's MLflow run (training.tracking.handoff)
    workdir: str = ""  # the driver's working directory (`stratkit.tuning.environment.resolve`)

    def tuner(self, partition: int, attempt: int) -> int:
        """The tuner id of a partition's attempt (see the module's docstring)."""
        return partition + self.num_tasks * attempt

    def env(self, partition: int, tuner: int) -> dict[str, str]:
        """The training process's variables of this plan: the search's, the run's, the driver's MLflow run."""
        return {**dict(self.extra_env),
                **environment.task_env(self.service, self.token, tuner, self.num_tasks, engine=self.engine,
                                       workdir=self.workdir),
                child_module.RUN_VAR: self.run_id, child_module.RANK_VAR: str(partition),
                child_module.NUM_TASKS_VAR: str(self.num_tasks), child_module.LABEL_VAR: f"tuner:{tuner}",
                child_module.RESULT_VAR: "1"}


def run_tuner(plan: TunerPlan, context: Any) -> Iterator[tuple[int, int, bytes]]:
    """The tuner task's body; yields `(partition, seq, chunk)`: its pickled result, then one info row."""
    partition = context.partitionId()
    tuner = plan.tuner(partition, context.attemptNumber())
    label = f"tuner:{tuner}"
    standby, _ = standby_for(plan)
    process = None
    aborted: list[str] = []

    def abort(reason: str) -> None:
        aborted.append(reason)
        if process is not None:
            process.kill(reason)

    client = LogClient(plan.log_host, plan.log_port, plan.log_token, partition, label, on_abort=abort,
                       timeout=LOG_CONNECT_SECONDS)
    workdir = task_workdir()
    code: int = SETUP_FAILED
    try:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
        env["CUDA_VISIBLE_DEVICES"] = context_devices(context, TaskRole(partition, "worker", partition),
                                                      use_gpu=plan.use_gpu, count=plan.gpu_count,
                                                      resource_name=plan.gpu_resource_name)
        env.update(plan.env(partition, tuner))
        with open(os.path.join(workdir, child_module.PAYLOAD), "wb") as handle:
            handle.write(plan.payload)
        client.line(f"[stratkit] {label} (partition {partition}, CUDA_VISIBLE_DEVICES="
                    f"{env['CUDA_VISIBLE_DEVICES']!r}) joins the search at "
                    f"{environment.format_address(*plan.service)}")

        def tell_driver(signum: int) -> None:  # from a signal handler: the client's lock may be held here
            threading.Thread(target=client.notice, args=(signal_name(signum),), daemon=True).start()

        with passing_on_notices(lambda: process.pid if process is not None else None,
                                (*NOTICES, *status.preemption_signals()), tell_driver):
            if not aborted:
                process = standby.start(workdir, env, client.line)
                if aborted:  # ABORT arrived while the process was being started
                    process.kill(aborted[0])
                code = process.stream()
        if code == 0 and process is not None:
            yield from result_chunks(partition, process.result_path())
    except GeneratorExit:
        raise
    except Exception as exc:  # noqa: BLE001 - told to the driver as this tuner's failure, not Spark's
        client.line(f"[stratkit] {label} could not start its training process: {type(exc).__name__}: {exc}")
    finally:
        client.exit_code(code)
        if process is not None:
            process.close()
        keep_or_close(plan, standby, process)
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)
    yield partition, INFO_SEQ, json.dumps({"tuner": tuner, "exit": code, "pid": getattr(process, "pid", None),
                                           "aborted": aborted[:1]}).encode()


def rdd_function(plan: TunerPlan):
    """The function for `rdd.mapPartitions`: yields `(partition, seq, chunk)` tuples."""

    def tuner_task(_: Iterator[Any]) -> Iterator[tuple[int, int, bytes]]:
        from pyspark import TaskContext

        yield from run_tuner(plan, TaskContext.get())

    return tuner_task


def arrow_function(plan: TunerPlan):
    """The function for `DataFrame.mapInArrow` (also over Spark Connect): record batches of (rank, seq, chunk)."""

    def tuner_task(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        yield from arrow_rows(batches, lambda: run_tuner(plan, TaskContext.get()))

    return tuner_task


__all__ = ["TunerPlan", "arrow_function", "rdd_function", "run_tuner"]
