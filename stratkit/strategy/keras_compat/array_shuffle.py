"""Arrays and ``PyDataset`` batches that ``model.fit`` shuffles: one order for every worker of a multi-worker strategy.

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

A ``keras.utils.PyDataset`` (``fit(shuffle=True)``, the default) has its batch
order drawn with Python's ``random.shuffle`` at each epoch (``PyDatasetAdapter``,
or its enqueuer's thread with ``workers > 1``): each worker draws from its own
Python state, so unless every worker seeded ``random`` alike the workers train
the slices of different batches together (measured, 4 batches, 2 workers: the
orders 0,2,3,1 and 1,0,2,3). Fix: when a multi-worker fit makes a shuffling
PyDataset adapter, the chief's state of Python's ``random`` is sent to every
worker (one collective), and the other workers' adapters draw their orders from
a private ``random.Random`` holding it: every worker draws the chief's orders,
which are what the chief alone, as one process, would draw. No worker's own
``random`` changes.

Installed by ``keras_compat.apply`` (the wrapped methods are Keras's own when no
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
_py_dataset_init: list[Any] = []
_active = threading.local()
UNSET = 2 ** 62  # larger than any seed the chief draws: MIN over the workers is the chief's seed


def _adapter_class() -> type:
    from keras.src.trainers.data_adapters import array_data_adapter

    return array_data_adapter.ArrayDataAdapter


def _py_dataset_module() -> Any:
    from keras.src.trainers.data_adapters import py_dataset_adapter

    return py_dataset_adapter


def _global_seed() -> Any:
    """TensorFlow's global seed (``tf.random.set_seed``), read without drawing an op seed."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    return context.global_seed() if context.executing_eagerly() else ops.get_default_graph().seed


@contextlib.contextmanager
def agreed_order(agree: Callable[[int], int],
                 chief_values: Callable[[list[int]], list[int] | None] | None = None) -> Iterator[None]:
    """Within: the arrays and PyDataset batches ``fit`` shuffles take one order on every worker.

    `agree(value)` is a collective every worker calls at the same point: it returns the chief's value.
    `chief_values(values)` is one too: the chief's list on the other workers, None on the chief.
    """
    _active.agree = agree
    _active.chief_values = chief_values
    try:
        yield
    finally:
        _active.agree = _active.chief_values = None
        module = _py_dataset_module() if _py_dataset_init else None
        if module is not None and isinstance(module.random, _ChiefRandom):
            module.random = random  # the chief's orders were for this fit


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


def unless_chief(is_chief: bool, values: list[int]) -> list[int] | None:
    """`values` (the chief's, from a collective) on the other workers; None on the chief, which keeps its own."""
    return None if is_chief else values


class _ChiefRandom(random.Random):
    """Python's ``random`` for Keras's PyDataset adapter on a non-chief worker: the chief's state, advanced alike."""


def _state_values() -> list[int]:
    """Python's ``random`` state as ints (Mersenne Twister: 624 words and a position)."""
    return list(random.getstate()[1])


def _py_dataset_adapter_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _py_dataset_init[0](self, *args, **kwargs)
    chief_values = getattr(_active, "chief_values", None)
    if chief_values is None or not self.shuffle:
        return
    state = chief_values(_state_values())  # every worker, here: the adapter is made in fit, before step 1
    if state is not None:
        drawn = _ChiefRandom()
        drawn.setstate((random.getstate()[0], tuple(state), None))
        _py_dataset_module().random = drawn  # its shuffles in this fit: the chief's orders


def install() -> bool:
    """Wrap ``ArrayDataAdapter.get_tf_dataset`` and ``PyDatasetAdapter.__init__`` (idempotent, each where Keras has
    it); False where Keras has no array adapter."""
    with _lock:
        if not _py_dataset_init:
            try:
                py_cls = _py_dataset_module().PyDatasetAdapter
                _py_dataset_init.append(py_cls.__dict__["__init__"])
                py_cls.__init__ = _py_dataset_adapter_init
            except Exception:  # noqa: BLE001 - another layout: a shuffled PyDataset keeps Keras's own orders
                pass
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
    """Give Keras its own methods back (for tests)."""
    with _lock:
        if _original:
            _adapter_class().get_tf_dataset = _original.pop()
        if _py_dataset_init:
            _py_dataset_module().PyDatasetAdapter.__init__ = _py_dataset_init.pop()
