"""``train_on_batch`` / ``test_on_batch`` / ``predict_on_batch`` on N replicas: each replica its share.

Cause (Keras 3.15.1, TF 2.21): the ``*_on_batch`` methods hand the whole,
undistributed batch to ``strategy.run``, so under Mirrored/MWMS with N > 1
replicas every replica computes every row: ``predict_on_batch``'s
``concat`` of the replicas' outputs returns each row N times (74 rows for
37), and ``train_on_batch``/``test_on_batch`` do N times the work (their
numbers came out right only because every replica saw the same batch).

Fix: while one of these methods runs on such a strategy, the step function it
calls gets the batch as per-replica values (``experimental_distribute_values_from_function``):
replica r of N takes the contiguous rows ``r*B/N ..`` (sizes differ by at most
one, an empty share when B < N), placed on its device. ``predict_on_batch``
concatenates the shares in replica order: each row once, in order. The train
and test steps run as ``fit``/``evaluate`` run theirs (:func:`.global_gradient.fit_mode`,
:mod:`.synced_logs`): the global batch's counts, one process's loss and
metrics. Every worker of an MWMS cluster passes the same batch (as it must for
these methods already). A batch this cannot split (no arrays or tensors, a
``sample_weight`` without ``y``, rows that disagree) keeps Keras's path.
Installed by :mod:`.fit_guards` with the guards on ``fit``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from stratkit.strategy.keras_compat import global_gradient, synced_logs
from stratkit.strategy.keras_compat.replicas import replicas_of, sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

METHODS = ("train_on_batch", "test_on_batch", "predict_on_batch")
#: the step function each method calls, as the model's attribute and its maker
_FUNCTIONS = {"train_on_batch": ("train_function", "make_train_function"),
              "test_on_batch": ("test_function", "make_test_function"),
              "predict_on_batch": ("predict_function", "make_predict_function")}
_local = threading.local()


def _rows(data: Any) -> int | None:
    """The batch's row count, or None when it cannot be split here."""
    import numpy as np
    import tensorflow as tf

    leaves = tf.nest.flatten(data)
    if not leaves or not all(isinstance(a, (np.ndarray, tf.Tensor)) and len(a.shape) for a in leaves):
        return None
    rows = {int(a.shape[0]) if a.shape[0] is not None else -1 for a in leaves}
    return rows.pop() if len(rows) == 1 and -1 not in rows else None


def _shares(strategy: Any, data: Any, rows: int) -> Any:
    """`data` as per-replica values: replica r of N holds its contiguous share of the rows, on its device."""
    import tensorflow as tf

    replicas, devices = strategy.num_replicas_in_sync, strategy.extended.worker_devices
    base, extra = divmod(rows, replicas)

    def share(context: Any) -> Any:
        r = context.replica_id_in_sync_group
        start = r * base + min(r, extra)
        stop = start + base + (1 if r < extra else 0)
        with tf.device(devices[r % len(devices)]):
            return tf.nest.map_structure(lambda a: tf.identity(tf.convert_to_tensor(a[start:stop])), data)

    return strategy.experimental_distribute_values_from_function(share)


def _splitting_function(name: str, strategy: Any, function: Any) -> Any:
    """`function` (the model's train/test/predict function) fed with the batch split over the replicas."""
    if name == "predict_on_batch":
        def predict(data: Any) -> Any:          # Keras passes [(x,)]
            (x,), = data
            rows = _rows(x)
            return function(data if rows is None else [(_shares(strategy, x, rows),)])
        return predict

    def step(iterator: Any) -> Any:             # Keras passes a generator of one (x, y, sample_weight)
        batch = next(iter(iterator))
        x, y, sample_weight = batch
        if y is None and sample_weight is not None:
            return function(iter([batch]))
        data = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
        rows = _rows(data)
        return function(iter([batch if rows is None else _shares(strategy, data, rows)]))
    return step


@contextlib.contextmanager
def _split(model: Any, name: str) -> Iterator[None]:
    attribute, maker = _FUNCTIONS[name]
    getattr(model, maker)()
    function = getattr(model, attribute)
    setattr(model, attribute, _splitting_function(name, model.distribute_strategy, function))
    try:
        yield
    finally:
        setattr(model, attribute, function)


def wrap(name: str, original: Any) -> Any:
    """Wrap one of :data:`METHODS` (see the module docstring)."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = self.distribute_strategy
        if (getattr(_local, "active", False) or not global_gradient.installed()
                or not replicas_of(strategy) or sync_replicas()):
            return original(self, *args, **kwargs)
        exact = name != "predict_on_batch"
        if exact:
            synced_logs.wrap_steps(self)         # before Keras makes its function from the step
        _local.active = True
        try:
            with global_gradient.fit_mode() if exact else contextlib.nullcontext(), _split(self, name):
                return original(self, *args, **kwargs)
        finally:
            _local.active = False

    setattr(method, _PATCH_MARK, True)
    return method
