"""Parameter-server clusters: serving `ps`/`worker` tasks and sizing thread pools.

A ps or worker task only hosts a `tf.distribute.Server`; the chief (the
coordinator) drives it. TensorFlow's servers never exit on their own, so the
chief ends them explicitly: at the end of training it runs one op *on each
task's device* that writes a marker file on that task's host
(`signal_done`). `serve` polls for that file and exits 0. If the chief
disappears without signalling (crashed), `serve` exits non-zero after a grace
period instead of hanging forever.

Where: in a private directory (mode 0700, this user's, not a symlink), never
under a predictable name in the shared temp directory, where another user could
end the tasks with a forged marker or, with a symlink, make the chief's write
land on one of the user's files. `stratkit launch` creates it (`mkdtemp`) and
passes it to every task in `STRATKIT_RUN_DIR`; the Spark runner names a fresh one
per attempt there; for tasks started by hand it is `<tempdir>/stratkit-<uid>`.
Each ps/worker task creates it if missing and refuses it if it is someone
else's, a symlink, or readable by others.

When: the chief signals once, at interpreter exit (`end_training_at_exit`,
registered when the chief's strategy is built), because the ps tasks hold the
model's variables: a script that calls `fit` twice, or saves or predicts after
`fit`, still needs them. If the chief's script dies of an uncaught exception,
the marker says "failed" and the tasks exit 1 at once (a job supervisor then
restarts the job, which resumes from `backup_dir`).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time

from stratkit import status
from stratkit.files import check_dir, read_bytes
from stratkit.cluster import ClusterSpec
from stratkit.errors import ConfigError

log = status.logger(__name__)

#: The private directory of the done markers, agreed by every task of a run (see the module docstring).
RUN_DIR_VAR = "STRATKIT_RUN_DIR"
GRACE_VAR = "STRATKIT_CHIEF_GRACE_SECONDS"
DEFAULT_GRACE = 120.0
#: How long a ps/worker task waits for a chief it has never seen (crashed before it started serving).
STARTUP_VAR = "STRATKIT_CHIEF_STARTUP_SECONDS"
DEFAULT_STARTUP = 1800.0

_DONE, _FAILED = "done", "failed"
_LINGER_SECONDS = 30.0
_signalled = False
_exit_hook_registered = False


def inter_op_threads(spec: ClusterSpec) -> int:
    """Inter-op threads for a PS-cluster process.

    Measured on 2 cores: with fewer than num_workers + 1 inter-op threads the
    coordinator's closures deadlock after the first step.
    """
    return max(spec.num_workers + 1, os.cpu_count() or 1)


def marker_dir() -> str:
    """The private directory of this run's done markers (the same path on every task of the run)."""
    explicit = os.environ.get(RUN_DIR_VAR)
    if explicit:
        return os.path.abspath(explicit)
    return os.path.join(tempfile.gettempdir(), f"stratkit-{os.geteuid()}")


def prepare_marker_dir() -> str:
    """Create the done-marker directory (0700) if missing; refuse one that is not private to this user.

    Raises:
        ConfigError: the directory is a symlink, someone else's, or readable by others.
    """
    return check_dir(marker_dir(), RUN_DIR_VAR, private=True)


def done_marker(spec: ClusterSpec, task_type: str, task_index: int) -> str:
    """Path (on that task's host, in `marker_dir()`) of the file the chief writes to end the task."""
    address = spec.cluster[task_type][task_index]
    safe = address.replace(":", "_").replace("[", "").replace("]", "").replace("/", "_")
    return os.path.join(marker_dir(), f"done-{task_type}-{task_index}-{safe}")


def _server_config(spec: ClusterSpec):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = inter_op_threads(spec)
    return config


def configure_coordinator(spec: ClusterSpec) -> None:
    """Size the chief's own thread pools before the coordinator connects."""
    import tensorflow as tf

    from stratkit.strategy.keras_compat import runtime_initialized

    if not runtime_initialized():
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads(spec))


def _chief_reachable(address: str) -> bool:
    from stratkit.strategy.startup import accepts_connection

    return accepts_connection(address, timeout=2)


def serve(spec: ClusterSpec, poll_seconds: float = 0.5) -> None:
    """Run this ps/worker task's server until the chief ends training, then exit the process.

    Exits 0 when the chief wrote this task's done marker; exits 1 when the
    marker says the chief failed, when the chief was seen and then stayed
    unreachable for `STRATKIT_CHIEF_GRACE_SECONDS` (default 120) without
    signalling, or when it never appeared within `STRATKIT_CHIEF_STARTUP_SECONDS`
    (default 1800), so a crashed chief never leaves a hung cluster behind.
    """
    import tensorflow as tf

    if spec.task_type not in ("ps", "worker") or spec.task_index is None:
        raise ConfigError(f"serve() is for ps and worker tasks: got task {spec.task_type}:{spec.task_index}. "
                          "Fix: call it only on a parameter-server cluster's ps/worker tasks")
    grace = float(os.environ.get(GRACE_VAR, DEFAULT_GRACE))
    startup = float(os.environ.get(STARTUP_VAR, DEFAULT_STARTUP))
    started = time.monotonic()
    prepare_marker_dir()
    marker = done_marker(spec, spec.task_type, spec.task_index)
    _remove_quietly(marker)  # a previous run's marker must not end this one
    server = tf.distribute.Server(tf.train.ClusterSpec(spec.cluster), job_name=spec.task_type,
                                  task_index=spec.task_index, protocol="grpc", config=_server_config(spec),
                                  start=True)
    log.info("%s:%s serving at %s; waiting for the chief to finish training", spec.task_type, spec.task_index,
             spec.address())
    chief = spec.cluster["chief"][0]
    seen_chief, gone_since = False, None
    while True:
        if os.path.lexists(marker):
            status = _read_quietly(marker)
            _remove_quietly(marker)
            if status == _FAILED:
                log.error("%s:%s: the chief failed; exiting 1 so the job can be restarted (it resumes from "
                          "backup_dir)", spec.task_type, spec.task_index)
            else:
                log.info("%s:%s done: the chief finished training", spec.task_type, spec.task_index)
            sys.stdout.flush()
            # Serve until the chief's process is gone: on exit its runtime still releases functions
            # on every task, and logs an error for each task that vanished first.
            deadline = time.monotonic() + _LINGER_SECONDS
            while _chief_reachable(chief) and time.monotonic() < deadline:
                time.sleep(0.2)
            # TF servers cannot be stopped cleanly; nothing of the user's is open here.
            os._exit(1 if status == _FAILED else 0)
        if _chief_reachable(chief):
            seen_chief, gone_since = True, None
        elif not seen_chief and time.monotonic() - started > startup:
            log.error("%s:%s: chief %s never came up in %.0fs; exiting. Set %s to wait longer.", spec.task_type,
                      spec.task_index, chief, startup, STARTUP_VAR)
            os._exit(1)
        elif seen_chief:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace:
                log.error("%s:%s: chief %s gone for %.0fs without ending training; exiting. Set %s to wait "
                          "longer.", spec.task_type, spec.task_index, chief, grace, GRACE_VAR)
                os._exit(1)
        time.sleep(poll_seconds)
    del server  # pragma: no cover


def _read_quietly(path: str) -> str:
    try:
        return read_bytes(path, RUN_DIR_VAR, limit=64).decode("utf-8", "replace").strip()
    except (OSError, ConfigError):
        return _DONE


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def signal_done(spec: ClusterSpec, failed: bool = False) -> None:
    """From the chief: end every ps and worker task by writing its marker on its own host.

    Only the first call in a process signals (the exit hook calls it too).
    `failed=True` makes the tasks exit 1 instead of 0.
    """
    import tensorflow as tf

    global _signalled
    if _signalled:
        return
    _signalled = True
    for task_type in ("worker", "ps"):
        for index in range(len(spec.cluster.get(task_type, []))):
            path = done_marker(spec, task_type, index)
            try:
                with tf.device(f"/job:{task_type}/replica:0/task:{index}/device:CPU:0"):
                    tf.io.write_file(path, _FAILED if failed else _DONE)
            except tf.errors.OpError as exc:  # a dead task has nothing to end
                log.warning("could not signal %s:%d to finish: %s", task_type, index, str(exc).splitlines()[0])


def end_training_at_exit(spec: ClusterSpec) -> None:
    """On the chief: signal the ps/worker tasks once, when this interpreter exits.

    Registered when the chief's strategy is built. An uncaught exception in the
    chief's script (Python sets `sys.last_value` before exit hooks run) sends
    "failed"; a normal end, or `sys.exit`, sends "done".
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    atexit.register(_signal_at_exit, spec)


def _signal_at_exit(spec: ClusterSpec) -> None:
    failed = getattr(sys, "last_value", None) is not None
    try:
        signal_done(spec, failed=failed)
    except Exception as exc:  # noqa: BLE001 - exiting anyway; the tasks' grace period covers it
        log.warning("could not signal the end of training: %r", exc)
