"""The training process of one Spark task: `stratkit.spark.child.main` in a new interpreter.

It may start before its run is known (`stratkit.spark.process`): then it
imports TensorFlow and Keras, and waits for one JSON line on stdin with the
run's working directory and complete environment.

Why a fresh process per task and run: Spark reuses its Python workers, and
TensorFlow fixes collectives and devices once per process ("Collective ops
are already configured" on the second MultiWorkerMirroredStrategy run in
spark-tensorflow-distributor). A new interpreter per run starts with no
TensorFlow state, with exactly the environment the task prepared (TF_CONFIG,
CUDA_VISIBLE_DEVICES), and can be killed as a whole process tree.

WORKDIR holds `payload.pkl` (cloudpickled `(train_fn, args, kwargs)`); on the
task whose return value is wanted, the result is cloudpickled to `result.pkl`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

PAYLOAD = "payload.pkl"
RESULT = "result.pkl"

#: Environment the task sets for this process (read here and by `stratkit.spark.task_info`).
RUN_VAR = "STRATKIT_SPARK_RUN"
RANK_VAR = "STRATKIT_SPARK_RANK"
NUM_TASKS_VAR = "STRATKIT_SPARK_NUM_TASKS"
LABEL_VAR = "STRATKIT_SPARK_TASK"
ATTEMPT_VAR = "STRATKIT_SPARK_ATTEMPT"
PARENT_VAR = "STRATKIT_SPARK_PARENT_PID"
RESULT_VAR = "STRATKIT_SPARK_RETURNS"
WRAP_VAR = "STRATKIT_SPARK_WRAP"
SHARD_VAR = "STRATKIT_SPARK_SHARD"  # "index/count" of this task's DataFrame shard
PRELOAD_VAR = "STRATKIT_SPARK_PRELOAD"  # "1": import TensorFlow and Keras while waiting for the run


def _die_with_parent() -> None:
    """Get SIGKILL when the Spark Python worker that started us dies (Spark kills it on task kill)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    parent = os.environ.get(PARENT_VAR)
    if parent and os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(137)


def _load(workdir: str):
    import cloudpickle

    with open(os.path.join(workdir, PAYLOAD), "rb") as handle:
        try:
            return cloudpickle.load(handle)
        except Exception as exc:
            raise RuntimeError(
                f"could not unpickle train_fn and its arguments in the training process ({type(exc).__name__}: "
                f"{exc}). Fix: define train_fn in the driver script or notebook (pickled by value), or install "
                "the module it lives in on every executor (same Python as PYSPARK_PYTHON)") from exc


def _resolve_data(value):
    """Replace staged DataFrames in the arguments with this task's `ParquetShard`."""
    from stratkit.spark.data import StagedData

    if not isinstance(value, StagedData):
        return value
    index, _, count = os.environ.get(SHARD_VAR, "0/1").partition("/")
    return value.shard(int(index), int(count))


def _call(fn, args, kwargs):
    args = tuple(_resolve_data(a) for a in args)
    kwargs = {k: _resolve_data(v) for k, v in kwargs.items()}
    if os.environ.get(WRAP_VAR) == "multi_worker_mirrored":
        # MirroredStrategyRunner(use_custom_strategy=False): the strategy is made for the user, through
        # stratkit so the Keras 3 multi-worker fixes apply, and train_fn runs in its scope.
        import stratkit

        strategy = stratkit.make_strategy(strategy="multi_worker_mirrored")
        with strategy.scope():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def _preload() -> None:
    """Import what every run needs, before the run is known: TensorFlow, Keras, pyspark's task context.

    Imports only: no TensorFlow context, server or device is created, so the
    run's TF_CONFIG and CUDA_VISIBLE_DEVICES (set later) still take effect.
    """
    for name in ("tensorflow", "keras", "cloudpickle", "pyspark.taskcontext", "stratkit.strategy.factory"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - the run imports what it needs and reports its own errors
            pass


def _set_name(name: str) -> None:
    """Name this process (/proc/PID/comm, 15 bytes) so a standby or a run's process can be found by PID."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def process_name(run_id: str) -> str:
    """The /proc/PID/comm of a run's training process."""
    return "sk" + run_id[-12:]


STANDBY_NAME = "stratkit-idle"
#: Printed once, right before train_fn is called: TensorFlow is imported and this process's start-up is over.
STARTED_LINE = "\x1e[stratkit] train_fn starts"


def _receive_run(argv: list[str]) -> str | None:
    """The run's working directory: from argv, or (spawned ahead) from one JSON line on stdin."""
    if len(argv) > 1:
        return argv[1]
    raw = sys.stdin.readline()
    if not raw:
        return None  # never used (a standby whose executor is going away, or a run that was cancelled)
    run = json.loads(raw)
    env = run["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
    return run["workdir"]


def main(argv: list[str]) -> int:
    _die_with_parent()
    spawned = time.time()
    preloaded = None
    if os.environ.get(PRELOAD_VAR) == "1":
        _set_name(STANDBY_NAME)
        _preload()
        preloaded = time.time()
    workdir = _receive_run(argv)
    if workdir is None:
        return 0
    _set_name(process_name(os.environ.get(RUN_VAR, "")))
    from stratkit import timeline

    timeline.mark("process started", spawned)
    if preloaded is not None:
        timeline.mark("tensorflow imported", preloaded)
    timeline.mark("run received")
    from stratkit.spark import context

    context.install_proxy()
    code = 0
    try:
        fn, args, kwargs = _load(workdir)
        timeline.mark("function starts")
        print(STARTED_LINE, flush=True)  # the task's cue to prepare the next standby (not shown to the user)
        result = _call(fn, args, kwargs)
        timeline.mark("function returns")
        if os.environ.get(RESULT_VAR) == "1":
            import cloudpickle

            tmp = os.path.join(workdir, RESULT + ".tmp")
            with open(tmp, "wb") as handle:
                cloudpickle.dump(result, handle)
            os.replace(tmp, os.path.join(workdir, RESULT))
            timeline.mark("result written")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            print(f"[stratkit] train_fn called sys.exit({exc.code!r})", file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        traceback.print_exc()
        # What the interpreter records for an uncaught exception, so exit hooks (e.g. the parameter-server
        # chief's "end training" signal) see that train_fn failed.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        code = 1
    return _exit_now(code)


def _exit_now(code: int) -> int:
    """Run the exit hooks, flush, and end the process without TensorFlow's slow teardown.

    Measured (TF 2.21, 2-worker MultiWorkerMirroredStrategy): a normal
    interpreter exit takes 1.5-4 s after the last Python line (the runtime's
    shutdown), and nothing of the user's is in it: the Python exit hooks
    (`atexit`: logging, the parameter-server chief's end-of-training signal)
    run here. No `gc.collect()`: with TensorFlow and Keras loaded it took
    seconds (4.3 s measured on the loaded test machine); a file object left
    open in a global is therefore not flushed (the README says to close files).
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main(sys.argv))
