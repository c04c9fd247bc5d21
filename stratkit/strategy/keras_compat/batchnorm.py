"""BatchNormalization on N > 1 replicas: every replica ends with the same statistics; one process's on request.

Keras 3's ``BatchNormalization()`` (``synchronized=False``, the default)
computes the mean and variance of each replica's own rows and updates each
replica's own moving statistics (their variables have no aggregation): the
workers end with different moving means, predictions and saved models.

* **Default: averaged moving statistics** (what TensorFlow's Keras 2 did, and
  what PyTorch DDP users get: each replica normalises its own rows). Before
  every validation, evaluation, prediction, at every epoch's end and at the end
  of training, :func:`average_moving_statistics` replaces each replica's moving
  statistics with their mean over the replicas, in one all-reduce for all
  layers (the moving average is linear, so this is the moving average of the
  replicas' mean batch statistics). The workers, their predictions and the
  saved model are then identical, at the cost of one small collective per epoch.
  One line at the start of ``fit`` says so, names the layers that train so
  (:func:`training_layer_names`: a ``base(x, training=False)`` that is
  trainable is among them) and gives the two fixes: the switch below, or
  freezing those layers (``layer.trainable = False``).
* ``STRATKIT_SYNC_BATCHNORM=1``: **one process's math**. The replacement for
  ``BatchNormalization._moments`` sums (sum, sum of squares, count) over the
  replicas in one all-reduce per layer and returns the global batch's moments,
  so outputs, gradients and moving statistics equal one process's (measured
  within 1e-8). That is ``synchronized=True`` with one all-reduce instead of
  Keras's three, and the count summed so an uneven or empty last shard weighs
  right; it costs one collective per layer in the forward pass and one in the
  backward pass (measured: 2 workers of a 9-BatchNorm ResNet at 0.73x the
  steps/s on loopback).

A masked call keeps Keras's own (per-replica) moments.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from stratkit.strategy.keras_compat.replicas import sync_replicas
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


def exact() -> bool:
    """True when ``STRATKIT_SYNC_BATCHNORM=1``: the global batch's moments (one process's math)."""
    return os.environ.get(ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


def _moments(self: Any, inputs: Any, mask: Any) -> Any:
    if mask is not None or self.synchronized or not sync_replicas() or not exact():
        return _originals["_moments"](self, inputs, mask)
    import tensorflow as tf

    if inputs.dtype in (tf.float16, tf.bfloat16):
        mean, variance = global_moments(tf.cast(inputs, tf.float32), list(self._reduction_axes))
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
    return global_moments(inputs, list(self._reduction_axes))


setattr(_moments, _PATCH_MARK, True)


def _per_replica_statistics(model: Any) -> list[Any]:
    """The moving statistics of every BatchNormalization layer that keeps per-replica moments."""
    cls = _layer_class()
    found = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, cls) and not layer.synchronized and getattr(layer, "moving_mean", None) is not None:
            found += [v for v in layer.non_trainable_variables]
    return found


def training_layer_names(model: Any) -> list[str]:
    """The BatchNormalization layers of `model` that train with each replica's own moments, as paths.

    A layer trains when it is trainable: Keras runs a frozen one (``layer.trainable = False``) in inference
    mode, but a trainable one called as ``base(x, training=False)`` in a functional model trains anyway
    once ``base.trainable = True`` (the outer call's ``training`` wins, keras-team/keras#20285). Empty with
    ``STRATKIT_SYNC_BATCHNORM=1`` (no per-replica moments) and for ``synchronized=True`` layers.
    """
    if exact():
        return []
    cls = _layer_class()
    names: list[str] = []
    seen: set[int] = set()

    def walk(layer: Any, prefix: str) -> None:
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if isinstance(child, cls):
                if child.trainable and not child.synchronized:
                    names.append(prefix + child.name)
            else:
                walk(child, f"{prefix}{child.name}/")

    walk(model, "")
    return names


def has_per_replica_statistics(model: Any) -> bool:
    """True when `model` has a BatchNormalization layer whose statistics would differ per replica."""
    return not exact() and bool(_per_replica_statistics(model))


def average_moving_statistics(model: Any, strategy: Any) -> None:
    """Set every replica's BatchNorm moving statistics to their mean over the replicas (one all-reduce).

    Called in the cross-replica context, on every worker at the same point (Keras callbacks run on all).
    """
    import tensorflow as tf

    variables = _per_replica_statistics(model)
    if not variables:
        return
    function = getattr(model, "_stratkit_average_bn", None)
    if function is None:
        tf_variables = [v.value for v in variables]

        def replica() -> None:
            context = tf.distribute.get_replica_context()
            local = [tf.identity(v) for v in tf_variables]
            flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in local], axis=0)
            mean = context.all_reduce(tf.distribute.ReduceOp.MEAN, flat)
            offset = 0
            for variable, value in zip(tf_variables, local):
                size = int(value.shape.num_elements())
                variable.assign(tf.cast(tf.reshape(mean[offset:offset + size], value.shape), variable.dtype))
                offset += size

        function = tf.function(lambda: strategy.run(replica))
        object.__setattr__(model, "_stratkit_average_bn", function)
    function()


def averaging_callback(model: Any, strategy: Any) -> Any:
    """A Keras callback that averages the moving statistics where Keras reads them (see the module docstring)."""
    import keras

    class AverageBatchNormStatistics(keras.callbacks.Callback):
        def average(self, *_: Any) -> None:
            average_moving_statistics(model, strategy)

        on_epoch_end = on_test_begin = on_predict_begin = on_train_end = average

    return AverageBatchNormStatistics()


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
