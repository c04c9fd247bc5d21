"""Arrays that ``model.fit`` shuffles: one order for every worker of a multi-worker strategy.

Cause (Keras 3.15.1, TF 2.21): for array inputs, ``fit(shuffle=True)`` (the
default) has Keras's TensorFlow adapter (``ArrayDataAdapter.get_tf_dataset``)
draw each epoch's order with ``tf.random.shuffle`` inside the input pipeline;
``shuffle="batch"`` shuffles each batch the same way. With no global seed that
op's seed is drawn per process, so under MultiWorkerMirroredStrategy every
worker draws its own order and then trains its slice of each global batch
from it. Measured on 2 workers, 8 one-hot rows, global batch 4, 3 epochs:
rows were trained 0 to 2 times an epoch (weights 0.20-0.71 where one process
gives 0.488 for every row). Nothing fails; the losses look normal.

Fix: while the adapter builds its pipeline under a multi-worker strategy and
no global seed is set, its ``tf.random.shuffle`` is a stateless shuffle keyed by
(a seed the chief draws and every worker receives, the pass number): a new
order every epoch (or batch), the same on every worker. With a global seed
(``keras.utils.set_random_seed``) every worker already draws Keras's own
order, the one a single process draws, so that is left alone.

Installed by ``keras_compat.apply`` (the wrapped method is Keras's own when no
:func:`agreed_order` is active); the fit guard opens :func:`agreed_order`. If a
Keras release stops calling ``tf.random.shuffle`` there, the order is not
agreed and a warning names the fix (set a global seed).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
from typing import Any, Callable, Iterator

from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

_lock = threading.Lock()
_original: list[Any] = []
_active = threading.local()
UNSET = 2 ** 62  # larger than any seed the chief draws: MIN over the workers is the chief's seed


def _adapter_class() -> type:
    from keras.src.trainers.data_adapters import array_data_adapter

    return array_data_adapter.ArrayDataAdapter


def _global_seed() -> Any:
    """TensorFlow's global seed (``tf.random.set_seed``), read without drawing an op seed."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    return context.global_seed() if context.executing_eagerly() else ops.get_default_graph().seed


@contextlib.contextmanager
def agreed_order(agree: Callable[[int], int]) -> Iterator[None]:
    """Within: the arrays ``fit`` shuffles take one order on every worker.

    `agree(value)` is a collective every worker calls at the same point: it returns the chief's value.
    """
    _active.agree = agree
    try:
        yield
    finally:
        _active.agree = None


def _seeded_shuffle(base: int, owner: int, real: Any) -> Any:
    """A ``tf.random.shuffle`` whose n-th run in a pipeline uses the stateless seed (base, n)."""
    passes = itertools.count()

    def shuffle(value: Any, seed: Any = None, name: Any = None) -> Any:
        import tensorflow as tf

        if threading.get_ident() != owner:  # another thread's shuffle while the pipeline is built
            return real(value, seed=seed, name=name)
        shuffle.used = True
        number = tf.py_function(lambda: next(passes), [], tf.int64)  # runs once per epoch (or batch)
        number.set_shape([])
        key = tf.stack([tf.constant(base, tf.int64), number])
        return tf.random.experimental.stateless_shuffle(value, seed=key, name=name)

    shuffle.used = False
    return shuffle


def _get_tf_dataset(self: Any) -> Any:
    agree = getattr(_active, "agree", None)
    if agree is None or not self._shuffle or _global_seed() is not None:
        return _original[0](self)
    import tensorflow as tf

    base = agree(random.SystemRandom().randrange(2 ** 31))
    real = tf.random.shuffle
    ours = _seeded_shuffle(base, threading.get_ident(), real)
    tf.random.shuffle = ours
    try:
        dataset = _original[0](self)
    finally:
        tf.random.shuffle = real
    if not ours.used:
        log.warning("model.fit(shuffle=%r) on several workers: this Keras shuffles arrays in a way stratkit "
                    "does not know, so each worker may draw its own order and train some rows twice and others "
                    "not at all. Fix: call keras.utils.set_random_seed(<the same int>) on every worker before "
                    "fit, or pass shuffle=False.", self._shuffle)
    return dataset


def install() -> bool:
    """Wrap ``ArrayDataAdapter.get_tf_dataset`` (idempotent); False where Keras has no such adapter."""
    with _lock:
        if _original:
            return True
        try:
            cls = _adapter_class()
            current = cls.__dict__["get_tf_dataset"]
        except Exception:  # noqa: BLE001 - another layout: the fit guard's warning is all that is left
            return False
        _original.append(current)
        setattr(_get_tf_dataset, _PATCH_MARK, True)
        cls.get_tf_dataset = _get_tf_dataset
        return True


def revert() -> None:
    """Give Keras its own method back (for tests)."""
    with _lock:
        if _original:
            _adapter_class().get_tf_dataset = _original.pop()
