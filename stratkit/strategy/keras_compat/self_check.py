"""The self-check for Keras versions stratkit did not test: are the two trainer bugs still there?

Runs the installed Keras functions in-process against a stand-in multi-worker
MWMS; see :func:`upstream_bugs_present`.
"""

from __future__ import annotations

import logging
from typing import Any

from stratkit.strategy.keras_compat.trainer_patches import _trainer_module

log = logging.getLogger(__name__)

#: Names of the upstream bugs the trainer patches fix, as reported by :func:`upstream_bugs_present`.
BUG_SYMBOLIC_BUILD = "keras-team/keras#20585 (_maybe_symbolic_build reduces the first batch)"
BUG_SCALAR_REDUCE = "tensorflow/tensorflow#72388 (reduce_per_replica reduces scalars with axis=0)"


def _probe_strategy_class() -> type:
    """A stand-in MWMS that claims multi-worker mode and records what Keras asks of it.

    It is an instance of ``tf.distribute.MultiWorkerMirroredStrategy`` (so
    Keras takes its multi-worker branches) but never touches a cluster. Its
    ``reduce`` fails exactly where the real one fails: on a value whose rank
    is too small for ``axis``, and on any cross-replica reduce of an input
    batch (which is what bug 1 does).
    """
    import contextlib

    import tensorflow as tf

    class _ProbeExtended:
        worker_devices = ("/job:worker/task:0/device:CPU:0",)

        def _in_multi_worker_mode(self) -> bool:
            return True

    class _ProbeStrategy(tf.distribute.MultiWorkerMirroredStrategy):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:  # deliberately no super().__init__: no cluster
            self._extended = _ProbeExtended()
            self.reduce_calls: list[tuple[str, Any]] = []
            self.batch_reduced = False

        @property
        def extended(self) -> Any:
            return self._extended

        @property
        def num_replicas_in_sync(self) -> int:
            return 2

        def scope(self) -> Any:
            return contextlib.nullcontext()

        def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
            if isinstance(value, tf.distribute.DistributedValues):
                return tuple(value.values)
            return (value,)

        def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
            self.reduce_calls.append((str(reduce_op), axis))
            if isinstance(value, (tuple, list, dict)):
                self.batch_reduced = True
                raise TypeError("probe: cross-replica reduce of an input batch")
            local = self.experimental_local_results(value)[0]
            rank = local.shape.rank
            if axis is not None and (rank is None or rank <= axis):
                raise ValueError(
                    f"probe: Invalid reduction dimension {axis} for input with {rank} dimensions"
                )
            return local

    return _ProbeStrategy


def upstream_bugs_present() -> list[str]:
    """Which of the two bugs the *currently installed* Keras functions still have.

    Runs both functions in-process against a stand-in multi-worker MWMS and
    symbolic tensors in a private ``tf.Graph``: no cluster, no eager op (so it
    is safe before the real MWMS is created), a few milliseconds. It fails
    closed: anything unexpected (a renamed function, a changed signature, a
    different call pattern) counts as "bug present".

    Returns an empty list only if both functions were seen to handle the
    failing inputs correctly.
    """
    try:
        import tensorflow as tf
        from tensorflow.python.distribute import values as tf_values

        m = _trainer_module()
        probe_cls = _probe_strategy_class()
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot verify"
        log.debug("keras_compat self-check could not start: %r", exc)
        return [BUG_SYMBOLIC_BUILD, BUG_SCALAR_REDUCE]

    present: list[str] = []
    with tf.Graph().as_default():
        x = tf.zeros((8, 4), tf.float32)
        y = tf.zeros((8, 1), tf.float32)
        loss = tf.constant(1.0)

        # Bug 1: build from a distributed first batch without reducing it.
        try:
            strategy = probe_cls()
            built: list[Any] = []

            class _Model:
                _distribute_strategy = strategy
                distribute_strategy = strategy

                def _symbolic_build(self, data_batch: Any = None) -> None:
                    built.append(data_batch)

            batch = (tf_values.PerReplica((x,)), tf_values.PerReplica((y,)))
            m.TensorFlowTrainer._maybe_symbolic_build(_Model(), iterator=[(0, 0, iter([batch]))])
            ok = (
                not strategy.batch_reduced
                and len(built) == 1
                and isinstance(built[0], (tuple, list))
                and len(built[0]) == 2
                and all(isinstance(t, tf.Tensor) for t in built[0])
                and [t.shape.as_list() for t in built[0]] == [[8, 4], [8, 1]]
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("keras_compat self-check, symbolic build: %r", exc)
            ok = False
        if not ok:
            present.append(BUG_SYMBOLIC_BUILD)

        # Bug 2: reduce scalar logs across workers.
        try:
            strategy = probe_cls()
            logs = {"loss": tf_values.PerReplica((loss,))}
            out = m.reduce_per_replica(logs, strategy, reduction="auto")
            ok = (
                isinstance(out, dict)
                and isinstance(out.get("loss"), tf.Tensor)
                and out["loss"].shape.rank == 0
                and len(strategy.reduce_calls) == 1
                and strategy.reduce_calls[0][0].upper().endswith("MEAN")
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("keras_compat self-check, scalar reduce: %r", exc)
            ok = False
        if not ok:
            present.append(BUG_SCALAR_REDUCE)
    return present
