"""The two fixes to Keras 3's TensorFlow trainer that let ``fit``/``evaluate`` run under multi-worker MWMS.

Keras 3's TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``) has
two bugs that stop ``fit``/``evaluate`` under ``MultiWorkerMirroredStrategy``
(MWMS) with two or more workers:

1. ``TensorFlowTrainer._maybe_symbolic_build`` builds the model from the first
   batch after *averaging that batch across replicas* with
   ``strategy.reduce("MEAN", batch, axis=None)``. Under multi-worker MWMS this
   raises ``ValueError: Attempt to convert a value (PerReplica:{...}) ... to a
   Tensor`` (keras-team/keras#20585). The batch is only needed for its shapes
   and dtypes, so we build from the first *local* replica's batch
   (``strategy.experimental_local_results(v)[0]``): no cross-worker traffic,
   same shapes.
2. The module function ``reduce_per_replica`` reduces the step's logs under
   multi-worker with ``strategy.reduce("MEAN", v, axis=0)``. Logs are scalars
   (rank 0), so this raises ``Invalid reduction dimension 0 for input with 0
   dimensions`` (tensorflow/tensorflow#72388). We reduce rank-0 values with
   ``axis=None`` (mean across replicas only) and leave every other case to the
   original function.

The replacement of ``_maybe_symbolic_build`` also lets a model with no
``call()`` of its own train under a strategy (Keras's DCGAN / VAE examples:
a ``train_step`` over sub-models held as attributes). Upstream builds every
model under a strategy by calling it, which such a model cannot do
(``RuntimeError: Unable to automatically build the model``, even on one
device), while Keras without a strategy defers building to the traced
``train_step``. We defer the same way for these models and build only the
compiled optimizer in the scope, as the symbolic build would.

Both replace private Keras functions; the gate (``keras_compat.apply``)
decides whether they are installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"

#: Keras's own functions while ours are installed (never rebound: the package re-exports this dict).
_originals: dict[str, Any] = {}


def _trainer_module() -> Any:
    """The Keras module holding the two patched functions (imported lazily)."""
    return importlib.import_module(_TRAINER_MODULE)


def _first_local_value(strategy: Any, value: Any) -> Any:
    """``value`` itself, or the first local replica's component of a distributed value."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> None:
    """Replacement for ``TensorFlowTrainer._maybe_symbolic_build``.

    Upstream averages the first distributed batch across replicas with
    ``strategy.reduce("MEAN", batch, axis=None)`` only to learn its shapes;
    under multi-worker MWMS that reduce fails (keras-team/keras#20585). The
    first local replica's batch has the same per-replica shapes and dtypes and
    needs no cross-worker communication, so we build from it. (The same MEAN
    is what makes MirroredStrategy crash with ``AddN must have the same size
    and shape`` on an uneven first batch; building from one replica's batch
    avoids that too.) Everything else (the early return without a strategy,
    consuming one batch from the first epoch iterator, building inside
    ``strategy.scope()``) is unchanged.
    """
    from keras.src import tree

    if self._distribute_strategy is None:
        # Without an explicit strategy Keras defers building to tracing time.
        return
    strategy = self.distribute_strategy
    if not has_forward_pass(self):
        # Nothing to call: train_step builds what it uses when traced, as Keras without a strategy does. The
        # compiled optimizer is built here, in the scope, since slots a replica step creates would not be mirrored.
        if self.optimizer is not None and not self.optimizer.built:
            with strategy.scope():
                self.optimizer.build(self.trainable_variables)
        return
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(lambda v: _first_local_value(strategy, v), batch)
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def has_forward_pass(model: Any) -> bool:
    """False for a ``keras.Model`` subclass without a ``call()`` of its own (it only overrides the steps)."""
    import keras

    return not isinstance(model, keras.Model) or type(model).call is not keras.Model.call


def _static_rank(strategy: Any, value: Any) -> int | None:
    """Static rank of a tensor or of a distributed value's local component, if known."""
    local = _first_local_value(strategy, value)
    shape = getattr(local, "shape", None)
    if shape is None:
        return None
    return getattr(shape, "rank", len(shape) if isinstance(shape, tuple) else None)


def _is_multi_worker_collective(strategy: Any) -> bool:
    """True for an MWMS whose cluster has more than one worker (where bug 2 bites)."""
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def _reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
    """Replacement for the module function ``reduce_per_replica``.

    Upstream, under multi-worker MWMS, ``"mean"`` (what ``"auto"`` means off
    TPU) calls ``strategy.reduce("MEAN", v, axis=0)`` for every value. For the
    scalar logs every train/test step returns that fails with ``Invalid
    reduction dimension 0 for input with 0 dimensions``
    (tensorflow/tensorflow#72388). A rank-0 value has no axis to average
    within a replica, so ``axis=None`` (average across replicas only) is the
    intended meaning. Values of rank >= 1 keep ``axis=0`` and every other
    reduction and strategy goes to the original function unchanged, so the
    patch changes nothing but the failing case.
    """
    original = _originals["reduce_per_replica"]
    if reduction not in ("auto", "mean") or not _is_multi_worker_collective(strategy):
        return original(values, strategy, reduction)

    from keras.src import tree

    import tensorflow as tf

    from stratkit.strategy.keras_compat.synced_logs import synced_keys

    same_everywhere = synced_keys()

    def _mean(v: Any) -> Any:
        axis = None if _static_rank(strategy, v) == 0 else 0
        if not isinstance(v, tf.distribute.DistributedValues) and not getattr(v, "device", "x"):
            # a log computed from all-reduced state (synced_logs) has no device; reduce needs one
            with tf.device(strategy.extended.worker_devices[0]):
                v = tf.identity(v)
        return strategy.reduce("MEAN", v, axis=axis)

    if isinstance(values, dict) and same_everywhere:
        # logs synced_logs computed from all-reduced state hold one value on every replica: no collective
        return {key: _first_local_value(strategy, v) if key in same_everywhere else tree.map_structure(_mean, v)
                for key, v in values.items()}
    return tree.map_structure(_mean, values)


setattr(_maybe_symbolic_build, _PATCH_MARK, True)
setattr(_reduce_per_replica, _PATCH_MARK, True)


def _install() -> None:
    """Swap the two Keras functions for ours; a second call is a no-op."""
    m = _trainer_module()
    cls = m.TensorFlowTrainer
    if not getattr(cls.__dict__.get("_maybe_symbolic_build"), _PATCH_MARK, False):
        _originals["_maybe_symbolic_build"] = cls.__dict__["_maybe_symbolic_build"]
        cls._maybe_symbolic_build = _maybe_symbolic_build
    if not getattr(m.reduce_per_replica, _PATCH_MARK, False):
        _originals["reduce_per_replica"] = m.reduce_per_replica
        m.reduce_per_replica = _reduce_per_replica


def _uninstall() -> None:
    """Put Keras's own functions back (nothing to do when ours were never installed)."""
    if not _originals:
        return
    m = _trainer_module()
    if "_maybe_symbolic_build" in _originals:
        m.TensorFlowTrainer._maybe_symbolic_build = _originals.pop("_maybe_symbolic_build")
    if "reduce_per_replica" in _originals:
        m.reduce_per_replica = _originals.pop("reduce_per_replica")
