"""BatchNormalization with N > 1 replicas normalises by the global batch's moments, as one process does.

Keras 3's ``BatchNormalization()`` (``synchronized=False``, the default)
computes the mean and variance of each replica's own rows and updates each
replica's own moving statistics (their variables have no aggregation): the
workers end with different moving means, predictions and saved models, and
none equals one process. In a replica context of a Mirrored/MWMS strategy with
N > 1 replicas, the replacement for ``BatchNormalization._moments`` sums
(sum, sum of squares, count) over the replicas in one all-reduce per layer and
returns the global batch's moments, so the outputs, the gradients and the
moving statistics are one process's, identical on every replica. This is what
``synchronized=True`` means, with one all-reduce instead of Keras's three, and
the count summed so an uneven or empty last shard weighs right.

A masked call keeps Keras's own (per-replica) moments. ``STRATKIT_SYNC_BATCHNORM=0``
turns this off (faster on a slow network; the replicas' statistics then differ).
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from stratkit.strategy.keras_compat.global_gradient import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_MODULE = "keras.src.layers.normalization.batch_normalization"
ENV_VAR = "STRATKIT_SYNC_BATCHNORM"

_lock = threading.Lock()
_originals: dict[str, Any] = {}


def global_moments(inputs: Any, axes: list[int]) -> tuple[Any, Any]:
    """Mean and variance over `axes` of the rows of every replica (float32 or wider), one all-reduce."""
    import tensorflow as tf

    dtype = inputs.dtype
    local_sum = tf.reduce_sum(inputs, axis=axes)
    local_squares = tf.reduce_sum(tf.square(inputs), axis=axes)
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), dtype)
    size = tf.size(local_sum)
    packed = tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_squares, [-1]), [count]], axis=0)
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, packed)
    total_count = total[-1]
    mean = tf.reshape(tf.math.divide_no_nan(total[:size], total_count), tf.shape(local_sum))
    squares = tf.reshape(tf.math.divide_no_nan(total[size:2 * size], total_count), tf.shape(local_sum))
    return mean, tf.maximum(squares - tf.square(mean), 0.0)


def _moments(self: Any, inputs: Any, mask: Any) -> Any:
    if mask is not None or self.synchronized or not sync_replicas() or os.environ.get(ENV_VAR, "1") == "0":
        return _originals["_moments"](self, inputs, mask)
    import tensorflow as tf

    if inputs.dtype in (tf.float16, tf.bfloat16):
        mean, variance = global_moments(tf.cast(inputs, tf.float32), list(self._reduction_axes))
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
    return global_moments(inputs, list(self._reduction_axes))


setattr(_moments, _PATCH_MARK, True)


def _layer_class() -> Any:
    return importlib.import_module(_MODULE).BatchNormalization


def install() -> None:
    """Install the replacement (idempotent)."""
    with _lock:
        cls = _layer_class()
        if not getattr(cls.__dict__.get("_moments"), _PATCH_MARK, False):
            _originals["_moments"] = cls.__dict__["_moments"]
            cls._moments = _moments


def uninstall() -> None:
    """Put Keras's method back (for tests)."""
    with _lock:
        if "_moments" in _originals:
            _layer_class()._moments = _originals.pop("_moments")


def self_check() -> list[str]:
    """What stops the replacement from being right on the installed Keras (empty: nothing)."""
    import inspect

    try:
        cls = _layer_class()
        method = _originals.get("_moments", cls.__dict__.get("_moments"))
        if method is None or list(inspect.signature(method).parameters) != ["self", "inputs", "mask"]:
            return ["BatchNormalization._moments(self, inputs, mask) is missing"]
        if "self._moments(" not in inspect.getsource(cls.call) or not hasattr(cls, "synchronized") and \
                "synchronized" not in inspect.getsource(cls.__init__):
            return ["BatchNormalization.call no longer takes its moments from _moments"]
    except Exception as exc:  # noqa: BLE001
        return [f"self-check failed: {exc!r}"]
    return []
