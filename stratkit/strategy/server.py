"""Parameter-server clusters: serving `ps`/`worker` tasks and sizing thread pools.

A ps or worker task only hosts a `tf.distribute.Server`; the chief (the
coordinator) drives it. TensorFlow's servers never exit on their own, so the
chief ends them explicitly: at the end of training it runs one op *on each
task's device* that writes a marker file on that task's host
(`signal_done`). `serve` polls for that file and exits 0. If the chief
disappears without signalling (crashed), `serve` exits non-zero after a grace
period instead of hanging forever.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time

from stratkit.cluster import ClusterSpec
from stratkit.errors import ConfigError

log = logging.getLogger(__name__)

GRACE_VAR = "STRATKIT_CHIEF_GRACE_SECONDS"
DEFAULT_GRACE = 120.0


def inter_op_threads(spec: ClusterSpec) -> int:
    """Inter-op threads for a PS-cluster process.

    Measured on 2 cores: with fewer than num_workers + 1 inter-op threads the
    coordinator's closures deadlock after the first step.
    """
    return max(spec.num_workers + 1, os.cpu_count() or 1)


def done_marker(spec: ClusterSpec, task_type: str, task_index: int) -> str:
    """Path (on that task's host) of the file the chief writes to end the task."""
    address = spec.cluster[task_type][task_index]
    safe = address.replace(":", "_").replace("[", "").replace("]", "").replace("/", "_")
    return os.path.join(tempfile.gettempdir(), f"stratkit-done-{task_type}-{task_index}-{safe}")


def _server_config(spec: ClusterSpec):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = inter_op_threads(spec)
    return config


def configure_coordinator(spec: ClusterSpec) -> None:
    """Size the chief's own thread pools before the coordinator connects."""
    import tensorflow as tf

    from stratkit.strategy.factory import runtime_initialized

    if not runtime_initialized():
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads(spec))


def _chief_reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def serve(spec: ClusterSpec, poll_seconds: float = 0.5) -> None:
    """Run this ps/worker task's server until the chief ends training, then exit the process.

    Exits 0 when the chief wrote this task's done marker; exits 1 when the
    chief was seen and then stayed unreachable for `STRATKIT_CHIEF_GRACE_SECONDS`
    (default 120) without signalling, so a crashed chief never leaves a hung
    cluster behind.
    """
    import tensorflow as tf

    if spec.task_type not in ("ps", "worker") or spec.task_index is None:
        raise ConfigError(f"serve() is for ps and worker tasks: got task {spec.task_type}:{spec.task_index}. "
                          "Fix: call it only on a parameter-server cluster's ps/worker tasks")
    grace = float(os.environ.get(GRACE_VAR, DEFAULT_GRACE))
    marker = done_marker(spec, spec.task_type, spec.task_index)
    if os.path.exists(marker):
        os.remove(marker)  # a previous run's marker must not end this one
    server = tf.distribute.Server(tf.train.ClusterSpec(spec.cluster), job_name=spec.task_type,
                                  task_index=spec.task_index, protocol="grpc", config=_server_config(spec),
                                  start=True)
    print(f"[stratkit] {spec.task_type}:{spec.task_index} serving at {spec.address()}; "
          "waiting for the chief to finish training", flush=True)
    chief = spec.cluster["chief"][0]
    seen_chief, gone_since = False, None
    while True:
        if os.path.exists(marker):
            _remove_quietly(marker)
            print(f"[stratkit] {spec.task_type}:{spec.task_index} done: the chief finished training", flush=True)
            sys.stdout.flush()
            os._exit(0)  # TF servers cannot be stopped cleanly; nothing of the user's is open here.
        if _chief_reachable(chief):
            seen_chief, gone_since = True, None
        elif seen_chief:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace:
                print(f"[stratkit] {spec.task_type}:{spec.task_index}: chief {chief} gone for {grace:.0f}s "
                      f"without ending training; exiting. Set {GRACE_VAR} to wait longer.", file=sys.stderr,
                      flush=True)
                os._exit(1)
        time.sleep(poll_seconds)
    del server  # pragma: no cover


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def signal_done(spec: ClusterSpec) -> None:
    """From the chief: end every ps and worker task by writing its marker on its own host."""
    import tensorflow as tf

    for task_type in ("worker", "ps"):
        for index in range(len(spec.cluster.get(task_type, []))):
            path = done_marker(spec, task_type, index)
            try:
                with tf.device(f"/job:{task_type}/replica:0/task:{index}/device:CPU:0"):
                    tf.io.write_file(path, "done")
            except tf.errors.OpError as exc:  # a dead task has nothing to end
                log.warning("could not signal %s:%d to finish: %s", task_type, index, str(exc).splitlines()[0])
