"""Metric logs that read as one process's: each step's results come from the metrics' state summed over replicas.

Keras 3 keeps each metric's state per replica (sync-on-read variables) and
logs the *mean of the replicas' results*: a ratio of sums becomes a mean of
ratios, wrong on an uneven last batch; a custom metric whose ``result()``
returns its state variable crashes the log reduction; a custom
``train_step``'s loss tracker reads 1/N. Here the model's step function is
wrapped (per model, once): after the user's ``train_step``/``test_step``
returns its logs, every metric variable's replica-local value is summed across
replicas in one all-reduce (per dtype), each metric's result is recomputed
from the summed state with ``Metric.stateless_result`` (the public stateless
API), and every log whose key names a metric gets that value. Keras's loss
tracker first gets the part of a replica that had no rows in the step
(:func:`.global_gradient.take_unweighted_loss`: Keras weighs it 0, and with
it the regularization loss every replica adds). Other logs are
read as tensors and left to Keras's own reduction. Every replica then holds
the same logs: what one process logs, for the whole global batch; so under
MWMS Keras's per-key cross-worker mean of those logs is skipped
(:func:`synced_keys`, read by ``trainer_patches._reduce_per_replica``): the
metric all-reduce replaces those collectives instead of adding to them.
"""

from __future__ import annotations

import functools
from typing import Any

import importlib
import threading
import weakref

from stratkit.strategy.keras_compat import global_gradient, replica_state
from stratkit.strategy.keras_compat.replicas import replicas_of, sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_WRAPPED = "_stratkit_synced_logs"
_TRAINER_MODULE = "keras.src.trainers.trainer"
_lock = threading.Lock()
_originals: dict[str, Any] = {}
_synced_keys: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()


def _tensor(value: Any) -> Any:
    """A log value as a tensor (a Keras or tf.distribute variable is read on this replica)."""
    import tensorflow as tf
    from keras.src import backend

    if isinstance(value, backend.Variable):
        value = value.value
    if isinstance(value, tf.Variable):
        return tf.identity(value)
    return value


def synchronize(model: Any, logs: Any, replicas: int) -> Any:
    """`logs` with every metric's entry computed from the metrics' state summed over the replicas."""
    import tensorflow as tf

    if not isinstance(logs, dict):
        return logs
    metrics = list(model.metrics)
    seen: dict[int, Any] = {}
    for metric in metrics:
        for variable in metric.variables:
            seen.setdefault(id(variable), variable)
    summed: dict[int, Any] = {}
    by_dtype: dict[Any, list[Any]] = {}
    for variable in seen.values():
        if variable.aggregation in ("sum", "mean"):
            by_dtype.setdefault(tf.as_dtype(variable.dtype), []).append(variable)
    context = tf.distribute.get_replica_context()
    for dtype, variables in by_dtype.items():
        wire = tf.float64 if dtype in (tf.float64, tf.int64) else tf.float32
        locals_ = [tf.identity(v.value) for v in variables]
        flat = tf.concat([tf.reshape(tf.cast(value, wire), [-1]) for value in locals_], axis=0)
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, flat)
        offset = 0
        for variable, value in zip(variables, locals_):
            size = int(value.shape.num_elements())
            part = tf.reshape(total[offset:offset + size], value.shape)
            offset += size
            if variable.aggregation == "mean":
                part = part / replicas
            summed[id(variable)] = tf.cast(part, dtype)
    results: dict[str, Any] = {}
    for metric in metrics:
        state = {id(v): summed.get(id(v), _tensor(v)) for v in metric.variables}
        result = metric.stateless_result(list(state.values()))

        def resolve(value: Any) -> Any:
            # a result() that returns its state variable (as the Metric docs show) gets the summed state
            return state.get(id(value), value) if value is not None else value

        if isinstance(result, dict):
            results.update({key: resolve(value) for key, value in result.items()})
        else:
            results[metric.name] = resolve(result)
    synced = {key for key in logs if key in results}
    with _lock:
        _synced_keys[tf.compat.v1.get_default_graph()] = frozenset(synced)
    return {key: results[key] if key in synced else _tensor(value) for key, value in logs.items()}


def synced_keys() -> frozenset[str]:
    """The log keys the step traced into the current graph synchronised: the same value on every replica,
    so Keras's cross-replica mean of them (a collective per key and step under MWMS) can be skipped."""
    import tensorflow as tf

    with _lock:
        return _synced_keys.get(tf.compat.v1.get_default_graph(), frozenset())


def _cast(value: Any, dtype: Any) -> Any:
    import tensorflow as tf

    return tf.cast(value, dtype)


def _synced(model: Any, step: Any) -> Any:
    @functools.wraps(step)
    def synced_step(data: Any) -> Any:
        replica_state.begin_step(model, data)      # this replica's rows, for state its layers assign
        logs = step(data)
        replicas = sync_replicas()
        if not replicas:
            return logs
        unweighted = global_gradient.take_unweighted_loss()
        tracker = getattr(model, "_loss_tracker", None)
        if unweighted is not None and tracker is not None:
            tracker.total.assign_add(_cast(unweighted, tracker.total.dtype))
        return synchronize(model, logs, replicas)

    setattr(synced_step, _WRAPPED, True)
    return synced_step


def _get_metrics_result_or_logs(self: Any, logs: Any) -> Any:
    """Replacement for ``Trainer._get_metrics_result_or_logs``: at an epoch's end Keras re-reads every
    metric outside the step, where a multi-worker sync-on-read variable a custom ``result()`` returns
    reads as this worker's own. The last step's synchronised logs are already the epoch's results."""
    if (isinstance(logs, dict) and logs and replicas_of(self.distribute_strategy)
            and getattr(self.train_step, _WRAPPED, False)):
        from keras.src.utils import python_utils

        return python_utils.pythonify_logs(logs)    # numbers, as Keras's own metric results are
    return _originals["_get_metrics_result_or_logs"](self, logs)


setattr(_get_metrics_result_or_logs, _PATCH_MARK, True)


def install() -> None:
    """Install the epoch-end replacement (idempotent); the steps are wrapped per model by :func:`wrap_steps`."""
    with _lock:
        cls = importlib.import_module(_TRAINER_MODULE).Trainer
        if not getattr(cls.__dict__.get("_get_metrics_result_or_logs"), _PATCH_MARK, False):
            _originals["_get_metrics_result_or_logs"] = cls.__dict__["_get_metrics_result_or_logs"]
            cls._get_metrics_result_or_logs = _get_metrics_result_or_logs


def uninstall() -> None:
    """Put Keras's method back (for tests)."""
    with _lock:
        if "_get_metrics_result_or_logs" in _originals:
            importlib.import_module(_TRAINER_MODULE).Trainer._get_metrics_result_or_logs = _originals.pop(
                "_get_metrics_result_or_logs")


def wrap_steps(model: Any) -> None:
    """Make `model`'s train and test steps log synchronised metrics (idempotent; the user's overrides kept)."""
    for name in ("train_step", "test_step"):
        step = getattr(model, name)
        if not getattr(step, _WRAPPED, False):
            object.__setattr__(model, name, _synced(model, step))
