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
decides whether they are installed. :func:`_install` also gates Keras's step
on its batch (:mod:`.step_gate`: the step that meets the end of an input of
unknown length runs nothing), on one device too.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratkit.strategy.keras_compat import step_gate
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

    Upstream pulls the first batch through an iterator of ``fit``'s (or
    ``evaluate``'s) input that it then throws away, and averages that batch
    across replicas with ``strategy.reduce("MEAN", batch, axis=None)``, only
    to learn its shapes. Both go wrong under a strategy:

    * under multi-worker MWMS the reduce fails (keras-team/keras#20585); on a
      local Mirrored it crashes on an uneven first batch (``AddN must have the
      same size and shape``);
    * the throwaway iterator reads the input, and an input that is not
      restarted by a new iterator loses what it read: a Python generator's
      batches in its prefetch buffer are never trained, and a ``PyDataset``
      with ``workers > 1`` leaves the batches its enqueuer prefetched in the
      enqueuer's ready queue, where the first epoch trains them ahead of batch
      0 and then stops short (measured, 16 batches, 2 epochs: no strategy
      trains each batch once an epoch; one device or 2 replicas trained some
      once and some three times, every run); a reshuffling ``tf.data`` input
      spends its first order there.

    Building needs only shapes and dtypes (``_symbolic_build`` turns the batch
    into ``KerasTensor``s), so we build from the distributed dataset's element
    spec, the first local replica's part of it: no batch is read, no
    collective runs, and every epoch reads the input as Keras without a
    strategy does (which defers building to the traced step, from those same
    specs). Where no spec can be read (a Keras whose epoch iterator changed)
    the first local replica's batch is pulled, as before. Everything else
    (the early return without a strategy, building inside
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
    if iterator is not None and data_batch is None:
        data_batch = _first_replica_spec(iterator)
    if iterator is not None and data_batch is None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(lambda v: _first_local_value(strategy, v), batch)
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _first_replica_spec(epoch_iterator: Any) -> Any:
    """The type specs of one local replica's batch of `epoch_iterator`'s distributed dataset; None if unreadable.

    ``TFEpochIterator`` keeps the distributed dataset it iterates in ``_distributed_dataset``; its
    ``element_spec`` holds a ``PerReplicaSpec`` (one spec per local replica, in ``_value_specs``) where
    there are several local replicas. An ``OptionalSpec`` (Keras's stand-in for a ``None`` a generator
    yields) is None, as the traced step reads it.
    """
    import tensorflow as tf

    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    try:
        spec = dataset.element_spec
    except Exception:  # noqa: BLE001 - no spec to read: the caller pulls a batch instead
        return None

    def local(leaf: Any) -> Any:
        if isinstance(leaf, tf.OptionalSpec):
            return None
        components = getattr(leaf, "_value_specs", None)
        leaf = components[0] if components else leaf
        return leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else _UNREADABLE

    local_spec = tf.nest.map_structure(local, spec)
    if any(leaf is _UNREADABLE for leaf in tf.nest.flatten(local_spec)):
        return None
    return local_spec


#: a spec leaf without a shape and a dtype (nothing to build a KerasTensor from)
_UNREADABLE = object()


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


def _is_chief(strategy: Any) -> bool:
    """Whether this task writes the run's files (``StrategyExtended.should_checkpoint``)."""
    try:
        return bool(strategy.extended.should_checkpoint)
    except Exception:  # noqa: BLE001 - an exotic strategy: behave as the single-process default
        return True


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
    """Swap the two Keras functions for ours, and gate the step on its input (:mod:`.step_gate`); idempotent."""
    step_gate.install()
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
    step_gate.uninstall()
    if not _originals:
        return
    m = _trainer_module()
    if "_maybe_symbolic_build" in _originals:
        m.TensorFlowTrainer._maybe_symbolic_build = _originals.pop("_maybe_symbolic_build")
    if "reduce_per_replica" in _originals:
        m.reduce_per_replica = _originals.pop("reduce_per_replica")
