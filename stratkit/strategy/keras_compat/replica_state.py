"""State a layer assigns in a replica step: one value on every replica, one process's for a mean over rows.

A layer written as Keras's "making new layers" guide writes one keeps state in
``self.add_weight(..., trainable=False)`` and assigns it in ``call()`` (a
running mean, a step counter). Keras's default for such a variable is
``aggregation="none"``, and TensorFlow then writes each replica's own value
into that replica's own copy: on a local Mirrored strategy the copies differ,
on several workers each worker keeps its own, with no error (measured: 2
workers 7.2e-2 apart in the weights, 6.9e-2 from one process).

Here, inside a guarded ``fit``/``evaluate`` on N > 1 replicas, every such
variable of the model's layers (:func:`register`; BatchNormalization's own
statistics are :mod:`.batchnorm`'s, random seeds :mod:`.replica_seeds`') is
set, at each assignment in a replica context, to the replicas' assigned values
averaged by each replica's rows in the step: one all-reduce of the value and
the row count. Over the replicas that is one process's value for any update
that is a mean over the rows (``m.assign(0.9 * m + 0.1 * mean(x))``: exact on
even and uneven splits; a replica without rows counts 0), an integer counter
(``steps.assign_add(1)``) stays right, and every other update is at least the
same on every replica and worker. A sum over rows (a row count) is not a mean:
such a variable wants ``aggregation="sum"`` and TensorFlow's own
``variable.value.assign_add(...)``, which adds each replica's part.

The first assignment a traced step makes names the variable, its layer and
what stratkit does to it, once per process. ``STRATKIT_REPLICA_STATE=keep``
leaves every replica its own value (Keras's behaviour); stratkit's replica
check (``stratkit.check_replicas``) then stops the run before a save once the
copies differ. Outside ``fit`` (a custom loop) nothing is registered: use
``aggregation="mean"`` there, and the check.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from stratkit.errors import ConfigError
from stratkit.strategy.keras_compat.replicas import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

ENV_VAR = "STRATKIT_REPLICA_STATE"
_MODES = ("average", "keep")
_MODULE = "keras.src.backend.tensorflow.core"
_BATCHNORM = "keras.src.layers.normalization.batch_normalization"
#: set on a Keras variable :func:`register` took in (a plain attribute: Keras variables overload ``==``)
_MARK = "_stratkit_replica_state"
#: on the model: how many of its variables are registered (0: its steps need no row count)
_MODEL_MARK = "_stratkit_replica_state_count"

_lock = threading.Lock()
_originals: dict[str, Any] = {}
_local = threading.local()      # per replica thread: (graph, this replica's rows in the step being traced)
_said: set[int] = set()


def mode() -> str:
    """``average`` (the default) or ``keep``, from :data:`ENV_VAR`.

    Raises:
        ConfigError: any other value.
    """
    value = os.environ.get(ENV_VAR, "average").strip().lower() or "average"
    if value not in _MODES:
        raise ConfigError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not one of {', '.join(_MODES)}. Fix: unset it "
                          f"(average: every replica's copy of a layer's assigned state is set to the replicas' "
                          f"row-weighted mean) or set {ENV_VAR}=keep (each replica keeps its own value)")
    return value


def _own_variables(layer: Any) -> list[Any]:
    return list(getattr(layer, "_non_trainable_variables", ()) or ())


def register(model: Any) -> list[Any]:
    """Mark the state :mod:`.replica_state` averages in `model`: every layer's own non-trainable variable with
    Keras's default ``aggregation="none"`` (not BatchNormalization's statistics, not a metric's). Idempotent.

    Returns:
        The variables marked (empty with ``STRATKIT_REPLICA_STATE=keep``).
    """
    if mode() == "keep":
        object.__setattr__(model, _MODEL_MARK, 0)
        return []
    batchnorm = importlib.import_module(_BATCHNORM).BatchNormalization
    found: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, batchnorm):
            continue
        for variable in _own_variables(layer):
            if (getattr(variable, "aggregation", None) == "none" and not variable.trainable
                    and getattr(variable, "synchronization", None) != "on_read"):
                found[id(variable)] = variable
    for variable in found.values():
        object.__setattr__(variable, _MARK, True)
    object.__setattr__(model, _MODEL_MARK, len(found))
    return list(found.values())


def _rows(data: Any) -> Any:
    """This replica's rows in a step's `data` (the leading size of its first tensor), or None."""
    import tensorflow as tf

    for leaf in tf.nest.flatten(data):
        if isinstance(leaf, tf.RaggedTensor):
            return leaf.nrows()
        if isinstance(leaf, tf.SparseTensor):
            return leaf.dense_shape[0]
        if hasattr(leaf, "shape") and getattr(leaf.shape, "rank", None):
            return tf.shape(leaf)[0]
    return None


def begin_step(model: Any, data: Any) -> None:
    """Called by the guarded train/test step on each replica before the user's step: keep this replica's rows
    for the assignments the step makes (nothing for a model without registered state: no op added)."""
    if not getattr(model, _MODEL_MARK, 0):
        return
    import tensorflow as tf

    _local.rows = (tf.compat.v1.get_default_graph(), _rows(data))


def _step_rows() -> Any:
    import tensorflow as tf

    stash = getattr(_local, "rows", None)
    if stash is None or stash[0] is not tf.compat.v1.get_default_graph():
        return None
    return stash[1]


def agreed_value(value: Any) -> Any:
    """In a replica context: the replicas' `value`s averaged by their rows in this step (equal weights where the
    step's rows are unknown), rounded for an integer variable; one all-reduce."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    value = tf.convert_to_tensor(value)
    wide = tf.cast(value, tf.float64)
    rows = _step_rows()
    if rows is None:
        mean = context.all_reduce(tf.distribute.ReduceOp.MEAN, wide)
    else:
        rows = tf.cast(rows, tf.float64)
        weighted = tf.where(rows > 0, wide * rows, tf.zeros_like(wide))     # a replica without rows: its mean is NaN
        total = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                   tf.concat([tf.reshape(weighted, [-1]), tf.reshape(rows, [1])], axis=0))
        mean = tf.reshape(total[:-1] / total[-1], tf.shape(wide))
    if value.dtype.is_integer:
        mean = tf.round(mean)
    return tf.cast(mean, value.dtype)


def _say_once(variable: Any) -> None:
    with _lock:
        if id(variable) in _said:
            return
        _said.add(id(variable))
    path = getattr(variable, "path", variable.name)
    layer = path.rsplit("/", 1)[0] if "/" in path else "?"
    log.warning("%d replicas: layer %r assigns its variable %r (trainable=False, aggregation='none') in the step. "
                "stratkit sets every replica's copy to the replicas' values averaged by their rows at each "
                "assignment (one all-reduce): one process's value for a mean over the rows (a running mean) and "
                "for a counter, the same on every replica and worker otherwise. A sum over the rows (a row count) "
                "is not a mean: create it with aggregation='sum' and add to it with variable.value.assign_add(...). "
                "%s=keep leaves each replica its own value (the replica check then stops the run).",
                sync_replicas(), layer, path, ENV_VAR)


def _direct_assign(self: Any, value: Any) -> Any:
    """Replacement for the TensorFlow backend's ``Variable._direct_assign`` (see the module docstring)."""
    original = _originals["_direct_assign"]
    if not getattr(self, _MARK, False) or self.trainable or not sync_replicas() or mode() == "keep":
        return original(self, value)
    import tensorflow as tf

    if not (tf.as_dtype(self.dtype).is_floating or tf.as_dtype(self.dtype).is_integer):
        return original(self, value)
    _say_once(self)
    return original(self, agreed_value(value))


setattr(_direct_assign, _PATCH_MARK, True)


def _variable_class() -> Any:
    return importlib.import_module(_MODULE).Variable


def install() -> None:
    """Install the replacement (idempotent)."""
    with _lock:
        cls = _variable_class()
        if not getattr(cls.__dict__.get("_direct_assign"), _PATCH_MARK, False):
            _originals["_direct_assign"] = cls.__dict__["_direct_assign"]
            cls._direct_assign = _direct_assign


def uninstall() -> None:
    """Put Keras's method back (for tests)."""
    with _lock:
        if "_direct_assign" in _originals:
            _variable_class()._direct_assign = _originals.pop("_direct_assign")


def self_check() -> list[str]:
    """What stops the replacement from being right on the installed Keras (empty: nothing)."""
    import inspect

    try:
        cls = _variable_class()
        method = _originals.get("_direct_assign", cls.__dict__.get("_direct_assign"))
        if method is None or list(inspect.signature(method).parameters) != ["self", "value"]:
            return ["the TensorFlow Variable._direct_assign(self, value) is missing"]
        common = importlib.import_module("keras.src.backend.common.variables").Variable
        if "_direct_assign(" not in inspect.getsource(common.assign):
            return ["Variable.assign no longer writes through _direct_assign"]
    except Exception as exc:  # noqa: BLE001
        return [f"self-check failed: {exc!r}"]
    return []
