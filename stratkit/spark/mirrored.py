"""`MirroredStrategyRunner`: a drop-in for spark-tensorflow-distributor's, with Keras 3 multi-worker working.

Same constructor, `get_num_tasks()` and `run(train_fn, **kwargs)` semantics as
`spark_tensorflow_distributor.MirroredStrategyRunner` 1.0.0:
  * tasks = ceil(num_slots / spark.task.resource.<gpu>.amount) with GPUs,
    num_slots without; num_slots GPUs split as evenly as possible over tasks;
  * a CUDA_VISIBLE_DEVICES preset on the executors (or the driver, in local
    mode) is remapped through Spark's GPU addresses;
  * local_mode runs train_fn on the driver, with num_slots of the driver's GPUs;
  * ValueError for num_slots <= 0; refuses a cluster with spark.ssl.enabled
    unless tensorflow.spark.distributor.ignoreSsl is true;
  * with use_custom_strategy=False, train_fn runs inside a
    MultiWorkerMirroredStrategy scope.

What changes, and why:
  * the strategy comes from `stratkit.make_strategy`, so Keras 3 `fit` works
    across workers (the peer's fails with "Attempt to convert a value
    (PerReplica...)");
  * train_fn runs in a fresh Python process per task (the peer runs it inside
    Spark's reused Python worker, so a second run fails with "Collective ops
    are already configured"); `BarrierTaskContext.get()` inside train_fn
    still works: it forwards to the task's context (`stratkit.spark.context`);
  * local_mode also runs train_fn in a fresh process (on the driver), not in
    the driver's own: its side effects on the driver's Python state (globals,
    imported modules, a TensorFlow context) do not persist, and train_fn and
    kwargs must be picklable with cloudpickle;
  * task output is streamed to the driver, failures raise
    `SparkTrainingError` with the task's last lines, and too few slots fail
    at once instead of after Spark's 10-minute barrier retry loop.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from stratkit.errors import ConfigError
from stratkit.process.pump import prefixed
from stratkit.process.report import TaskFailure, format_failure_report
from stratkit.spark import child as child_module
from stratkit.spark import layout
from stratkit.spark.failures import REPORT_TITLE, SparkTrainingError
from stratkit.spark.confs import read_confs, spark_context
from stratkit.process.payload import pickle_payload
from stratkit.spark.runner import SparkRunner

#: The logger spark-tensorflow-distributor uses (its class name), so its users' log filters keep working.
log = logging.getLogger("MirroredStrategyRunner")


def _configure_logger() -> None:
    """Set up as the peer does when a runner is made: INFO, to stderr when nothing else is configured."""
    log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(logging.StreamHandler())

_WRAP = "multi_worker_mirrored"


class MirroredStrategyRunner:
    """Run synchronous data-parallel TensorFlow training on Spark (spark-tensorflow-distributor's API).

    Args:
        num_slots: GPUs (use_gpu=True) or CPU tasks (use_gpu=False) to train on; > 0.
        local_mode: run train_fn on the driver instead of the executors.
        use_gpu: schedule GPUs through Spark resource `gpu_resource_name`.
        gpu_resource_name: the Spark resource name of GPUs.
        use_custom_strategy: True when train_fn builds its own strategy; False
            runs it inside a MultiWorkerMirroredStrategy scope made by stratkit.
    """

    def __init__(self, *, num_slots: int, local_mode: bool = False, use_gpu: bool = True,
                 gpu_resource_name: str = "gpu", use_custom_strategy: bool = False) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ConfigError(f"num_slots must be a positive integer: got {num_slots!r}. Fix: e.g. num_slots=2 "
                              "(GPUs with use_gpu=True, CPU tasks with use_gpu=False)")
        self._num_slots = num_slots
        self._local_mode = local_mode
        self._use_gpu = use_gpu
        self._gpu_resource_name = gpu_resource_name
        self._use_custom_strategy = use_custom_strategy
        _configure_logger()
        from pyspark.sql import SparkSession

        self._spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        self.sc = spark_context(self._spark)
        self.last_run = None
        log.info("Doing %s training...", "GPU" if use_gpu else "CPU")
        if local_mode:
            log.warning("MirroredStrategyRunner will run in local mode on the driver node; there would be resource "
                        "contention if the driver also runs other workloads.")
            self._num_tasks = None
        else:
            self._num_tasks = self.get_num_tasks()
            log.info("Will run with %d Spark tasks.", self._num_tasks)

    def get_num_tasks(self) -> int:
        """Spark tasks used for distributed training: ceil(num_slots / GPUs per task), or num_slots on CPU."""
        if not self._use_gpu:
            return self._num_slots
        key = f"spark.task.resource.{self._gpu_resource_name}.amount"
        confs = read_confs(self._spark, self.sc)
        if key not in confs:
            raise ConfigError(f"Your cluster might not have Spark GPU-aware scheduling enabled: the conf {key} was "
                              "not found in the Spark configuration. Fix: set it (GPUs per task) with the executor "
                              "GPU confs, or pass use_gpu=False")
        amount = int(float(confs[key]))
        if amount < 1:
            raise ConfigError(f"The Spark conf {key} has a value of {confs[key]} but it should not be less than 1. "
                              f"Fix: set {key}=1 or more")
        return math.ceil(self._num_slots / amount)

    def run(self, train_fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Run `train_fn(**kwargs)`; return the chief's (partition 0's) value, or train_fn's value in local mode."""
        if self._local_mode:
            return self._run_local(train_fn, **kwargs)
        tasks = self._num_tasks or self.get_num_tasks()
        runner = SparkRunner(num_workers=tasks, use_gpu=self._use_gpu, spark=self._spark)
        runner._api_name, runner._log = type(self).__name__, log  # SparkRunner.run checks SSL, once
        runner._gpu_resource_name = self._gpu_resource_name
        if self._use_gpu:
            counts = [layout.split_evenly(self._num_slots, tasks, rank) for rank in range(tasks)]
            if len(set(counts)) > 1:  # the tasks would refuse it (layout.check_gpu_counts): say so before any job
                per_task = math.ceil(self._num_slots / tasks)
                raise ConfigError(f"num_slots={self._num_slots} over {tasks} Spark tasks gives them "
                                  f"{' and '.join(map(str, sorted(set(counts), reverse=True)))} GPUs: workers with "
                                  "different GPU counts cannot train in one MultiWorkerMirrored cluster. Fix: "
                                  f"num_slots a multiple of spark.task.resource.{self._gpu_resource_name}.amount "
                                  f"(e.g. num_slots={per_task * tasks} or {per_task * (tasks - 1) or per_task})")
            runner._gpu_counts = counts
        runner._wrap = None if self._use_custom_strategy else _WRAP
        try:
            return runner.run(train_fn, **kwargs)
        finally:
            self.last_run = runner.last_run

    def _run_local(self, train_fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Train on the driver, in a fresh process so the driver's own TensorFlow state never interferes."""
        from stratkit.spark.process import TrainingProcess

        if self._use_gpu:
            resources = self.sc.resources if self.sc is not None else {}
            if self._gpu_resource_name not in resources:
                raise ConfigError(f"The GPU resource {self._gpu_resource_name!r} was not found in the driver's "
                                  f"resources. Fix: set spark.driver.resource.{self._gpu_resource_name}.amount and "
                                  f"spark.driver.resource.{self._gpu_resource_name}.discoveryScript, or pass "
                                  "use_gpu=False")
            owned = layout.remap_visible(
                layout.check_gpu_addresses(resources[self._gpu_resource_name].addresses, self._gpu_resource_name),
                os.environ.get("CUDA_VISIBLE_DEVICES"), where="the driver")
            if self._num_slots > len(owned):
                raise ConfigError(f"{self._num_slots} slots were requested for local training with GPUs, but only "
                                  f"{len(owned)} GPUs are available to the driver. Fix: num_slots <= {len(owned)}")
            visible = ",".join(owned[: self._num_slots])
        else:
            if self._num_slots > 1:
                raise ConfigError(f"Cannot run with more than 1 CPU slot in local mode (num_slots={self._num_slots}). "
                                  "Fix: num_slots=1, or local_mode=False to use the executors")
            visible = ""
        workdir = tempfile.mkdtemp(prefix="stratkit-local-")
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)  # local mode is one process, whatever the driver's environment says
        env.update({"CUDA_VISIBLE_DEVICES": visible, child_module.RESULT_VAR: "1", child_module.RANK_VAR: "0",
                    child_module.NUM_TASKS_VAR: "1", child_module.LABEL_VAR: "local:0"})
        if not self._use_custom_strategy:
            env[child_module.WRAP_VAR] = _WRAP
        process = None
        try:
            with open(os.path.join(workdir, child_module.PAYLOAD), "wb") as handle:
                handle.write(pickle_payload(train_fn, (), kwargs, where="the Spark tasks"))
            process = TrainingProcess(workdir, env, lambda text: print(prefixed("local:0", text), flush=True))
            code = process.stream()
            if code != 0:
                lines = list(process.tail)
                report = format_failure_report(TaskFailure("local:0", code, tuple(lines)), title=REPORT_TITLE)
                raise SparkTrainingError(f"local training on the driver failed with exit code {code}.\n{report}",
                                         task="local:0", rank=0, exit_code=code, lines=lines, attempt=1)
            path = process.result_path()
            if not os.path.exists(path):
                return None
            import cloudpickle

            with open(path, "rb") as handle:
                return cloudpickle.load(handle)
        finally:
            if process is not None:
                process.close()
            shutil.rmtree(workdir, ignore_errors=True)
