"""The training process of one Spark task, and the standby it is forked from.

The standby is this module's `main()` in a new interpreter, started by the
task (`stratkit.spark.process`) with `stratkit.process.children.start_child`,
so it dies with the Spark Python worker. It imports TensorFlow and Keras --
no TensorFlow context, server or device -- then serves runs on its control
socket (fd 0, a Unix SEQPACKET socket): each request names a run's working
directory and carries the write end of the run's output pipe; the standby
forks the run's training process (`stratkit.process.children.fork_child`),
replies with its PID, waits for it, and replies with its exit code. It exits
when the task closes the socket.

Why a fresh process per task and run: Spark reuses its Python workers, and
TensorFlow fixes collectives and devices once per process ("Collective ops
are already configured" on the second MultiWorkerMirroredStrategy run in
spark-tensorflow-distributor). A process forked from the standby starts with
no TensorFlow state, gets exactly the environment the task prepared
(TF_CONFIG, CUDA_VISIBLE_DEVICES: TensorFlow reads both when its context
starts, after the fork), and is killed as a whole process group.

Why fork, and why it is safe here: the old standby was a spawned process
used once and replaced; its replacement's TensorFlow import (4 s of CPU)
then competed with the next run's training on the executor's cores, and a
run started right after the previous one found it still importing (measured:
"tensorflow imported" 1.4 s after the run was handed over; training 3.9 s
against 3.0 s alone). Forked, a run starts with everything imported and no
import ever runs beside training. After `import tensorflow, keras` the
standby has four threads, none of them TensorFlow's (checked with gdb):
its main thread, OpenBLAS's two idle thread servers (numpy's and scipy's;
OpenBLAS re-creates them after fork) and jemalloc's background thread
(pyarrow's; jemalloc takes its locks around fork). TensorFlow's own threads
start with its context, which only the forked child creates.

WORKDIR holds `payload.pkl` (cloudpickled `(train_fn, args, kwargs)`) and
`run.json` (the run's environment); on the task whose return value is
wanted, the result is cloudpickled to `result.pkl`.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time

from stratkit.process.payload import PAYLOAD, RESULT, exit_now, load_payload, run_function  # noqa: F401 - names the task uses

RUN = "run.json"

#: Environment the task sets for the training process.
RUN_VAR = "STRATKIT_SPARK_RUN"
RANK_VAR = "STRATKIT_SPARK_RANK"
NUM_TASKS_VAR = "STRATKIT_SPARK_NUM_TASKS"
LABEL_VAR = "STRATKIT_SPARK_TASK"
ATTEMPT_VAR = "STRATKIT_SPARK_ATTEMPT"
RESULT_VAR = "STRATKIT_SPARK_RETURNS"
WRAP_VAR = "STRATKIT_SPARK_WRAP"
SHARD_VAR = "STRATKIT_SPARK_SHARD"  # "index/count" of this task's DataFrame shard
PRELOAD_VAR = "STRATKIT_SPARK_PRELOAD"  # "1": the standby imports TensorFlow and Keras before its first run
#: The largest control message (a request names a directory; replies are a PID and an exit code).
MESSAGE_BYTES = 64 * 1024


def _load(workdir: str):
    return load_payload(workdir, fix="define train_fn in the driver script or notebook (pickled by value), or "
                                     "install the module it lives in on every executor (same Python as PYSPARK_PYTHON)")


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


def main(argv: list[str]) -> int:
    """The standby: import (when STRATKIT_SPARK_PRELOAD=1), then fork one training process per request on fd 0."""
    from stratkit.process.children import fork_child

    _set_name(STANDBY_NAME)
    # No garbage collection here, and everything imported frozen: the forks' collections then never walk
    # (and copy, page by page) the standby's million import-time objects. Measured in forked 2-worker runs:
    # a full collection took 1.4 s of a run's time without the freeze; with it, every run's collections
    # together took 0.03-0.14 s (the pattern gc.freeze's documentation describes for fork servers).
    gc.disable()
    preloaded = None
    if os.environ.get(PRELOAD_VAR) == "1":
        from stratkit.spark.preload import preload

        preload()
        preloaded = time.time()
    channel = socket.socket(fileno=0)  # the task's end is a SEQPACKET socketpair: one message per request
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 1)
        except OSError:
            message, fds = b"", []
        if not message or not fds:  # the task closed the channel (the executor is going away, or no more runs)
            os._exit(0)  # nothing to tear down: no TensorFlow context was ever created here
        workdir = json.loads(message)["workdir"]
        gc.freeze()
        forked = time.time()
        pid = fork_child(lambda: _run(workdir, preloaded, forked), output_fd=fds[0])
        os.close(fds[0])
        try:
            channel.send(json.dumps({"pid": pid}).encode())
            _, status = os.waitpid(pid, 0)
            channel.send(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # the task is gone; its run dies with us (die-with-parent)
            os._exit(0)


def _run(workdir: str, preloaded: float | None, forked: float) -> int:
    """The forked training process: take the run's environment, call train_fn, write its result."""
    gc.enable()  # for what the run allocates; the standby's objects stay frozen
    with open(os.path.join(workdir, RUN), encoding="utf-8") as handle:
        env = json.load(handle)["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
    _set_name(process_name(os.environ.get(RUN_VAR, "")))
    if "numpy" in sys.modules:  # its global generator was seeded once in the standby: every fork would repeat it
        sys.modules["numpy"].random.seed()
    from stratkit import timeline

    timeline.mark("process forked", forked)
    if preloaded is not None:
        timeline.mark("tensorflow imported", preloaded)
    timeline.mark("run received")
    from stratkit.spark import context

    context.install_proxy()

    def call():
        fn, args, kwargs = _load(workdir)
        timeline.mark("function starts")
        return _call(fn, args, kwargs)

    code = run_function(call, workdir, keep_result=os.environ.get(RESULT_VAR) == "1", mark=timeline.mark)
    return exit_now(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
