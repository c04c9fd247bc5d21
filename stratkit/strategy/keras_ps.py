"""The private Keras and TensorFlow pieces the parameter-server loop runs on, behind the version gate.

Keras 3 has no parameter-server trainer, so the training layer's `training/ps/` drives a
model through Keras' own trainer internals: the symbolic build that creates
every variable before a step is scheduled, the loss computation and loss
tracker Keras' `train_step` uses, whether `call` takes `training=`. TensorFlow
has no public way to ship a dataset to a worker or to save a sharded variable.
Each use is one small function here, named for what it does; nothing else in
the training layer (`training/`) touches a private Keras or TensorFlow name.

The gate: `check(model)` runs before any of these is used. It is
`keras_compat.check_parameter_server` (below the Keras floor refused, an
untested Keras refused unless `STRATKIT_KERAS_COMPAT=force`, the trainer
internals present) plus the self-check of what this module adds
(`internals_missing`). Each function also fails closed with a
`KerasCompatError` naming what is missing, never an `AttributeError` deep in a
scheduled step.

Imports neither TensorFlow nor Keras at import time.
"""

from __future__ import annotations

import types
from typing import Any

from stratkit.errors import KerasCompatError
from stratkit.strategy import keras_compat

__all__ = ["allow_saving_sharded", "call_model", "check", "compute_loss", "dataset_graph", "internals_missing",
           "model_state", "overrides_train_step", "shards_of", "symbolic_build", "update_loss_tracker"]

_STATE = "_stratkit_state"
_TRAINER = "keras.src.backend.tensorflow.trainer"
_UNSCALE = "keras.src.losses.loss"
_SHARDED = "tensorflow.python.distribute.sharded_variable"


def _missing(what: str) -> KerasCompatError:
    return KerasCompatError(
        f"Keras {keras_compat.installed_keras_version()} / this TensorFlow has no {what}, which stratkit's "
        f"parameter-server loop uses. Fix: install a version stratkit was tested on "
        f"({keras_compat.supported_range()})")


def _import(module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}") from None


# --------------------------------------------------------------------------------------------
# The gate and its self-check
# --------------------------------------------------------------------------------------------


def internals_missing() -> list[str]:
    """What this module uses beyond `keras_compat.parameter_server_internals_missing` and cannot find.

    Fails closed: anything that cannot be imported or inspected counts as missing.
    """
    import importlib

    missing = []
    for module, name in ((_TRAINER, "TensorFlowTrainer"), (_UNSCALE, "unscale_loss_for_distribution"),
                         (_SHARDED, "ShardedVariable")):
        try:
            getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - any failure means "cannot verify"
            missing.append(f"{module}.{name}")
    try:
        import tensorflow as tf

        if not hasattr(tf.data.Dataset.range(1), "_variant_tensor"):
            missing.append("tf.data.Dataset._variant_tensor")
        if not hasattr(tf.raw_ops, "DatasetToGraphV2") or not hasattr(tf.raw_ops, "DatasetFromGraph"):
            missing.append("tf.raw_ops.DatasetToGraphV2/DatasetFromGraph")
    except Exception:  # noqa: BLE001
        missing.append("tensorflow")
    return missing


def check(model: Any = None) -> None:
    """The version gate for parameter-server training: refuse up front what the loop could not run.

    Raises:
        KerasCompatError: naming the version, what is missing and the fix.
    """
    keras_compat.check_parameter_server(model)
    missing = internals_missing()
    if missing:
        raise _missing(", ".join(missing))


# --------------------------------------------------------------------------------------------
# Building: every variable before the first scheduled step
# --------------------------------------------------------------------------------------------


def symbolic_build(model: Any, element_spec: Any, optimizer_targets: Any) -> None:
    """Create the model's, the compiled loss's and metrics' variables from `element_spec` (no op runs).

    Keras' own fit does this with `Model._symbolic_build`; call it in the
    strategy's scope. The optimizer is built over `optimizer_targets(model)`
    instead of over the model's variables, so a variable split by a
    `variable_partitioner` gets one slot per shard, on that shard's ps.
    """
    build = getattr(model, "_symbolic_build", None)
    if build is None:  # pragma: no cover - Keras moved its internals
        raise _missing("Model._symbolic_build")
    optimizer = model.optimizer
    build_optimizer = optimizer is not None and not optimizer.built
    if build_optimizer:
        optimizer.built = True  # keep _symbolic_build from building it over the unsplit variables
    try:
        build(data_batch=tuple(element_spec) if isinstance(element_spec, list) else element_spec)
    finally:
        if build_optimizer:
            optimizer.built = False
    if build_optimizer:
        optimizer.build(optimizer_targets(model))


def overrides_train_step(model: Any) -> bool:
    """True when the model's class replaces Keras' TensorFlow `train_step` (the loop cannot run it)."""
    trainer = _import(_TRAINER, "TensorFlowTrainer")
    return getattr(type(model), "train_step", None) is not trainer.train_step


# --------------------------------------------------------------------------------------------
# Sharded variables
# --------------------------------------------------------------------------------------------


def shards_of(variable: Any) -> list[Any] | None:
    """The shards of a Keras variable that holds a `ShardedVariable` (a `variable_partitioner`), else None."""
    sharded = _import(_SHARDED, "ShardedVariable")
    value = getattr(variable, "value", None)
    return list(value.variables) if isinstance(value, sharded) else None


def allow_saving_sharded() -> None:
    """Let Keras save a sharded variable: it reads weights with `np.asarray(variable)`.

    TensorFlow's ShardedVariable converts to a tensor (its shards concatenated)
    but has no `__array__`; adding one changes nothing else (a monkey-patch of
    a TensorFlow class, hence here). Loading already works
    (`ShardedVariable.assign` splits the value over the shards).
    """
    sharded = _import(_SHARDED, "ShardedVariable")
    if "__array__" in vars(sharded):
        return
    import numpy as np
    import tensorflow as tf

    def __array__(self: Any, dtype: Any = None, copy: Any = None) -> Any:  # noqa: N807
        return np.asarray(tf.convert_to_tensor(self).numpy(), dtype=dtype)

    sharded.__array__ = __array__


# --------------------------------------------------------------------------------------------
# One step: forward pass, loss, loss tracker
# --------------------------------------------------------------------------------------------


def call_model(model: Any, x: Any, *, training: bool) -> Any:
    """`model(x, training=...)`, or `model(x)` when its `call` takes no `training` (as Keras' train_step)."""
    takes_training = getattr(model, "_call_has_training_arg", None)
    if takes_training is None:
        raise _missing("Layer._call_has_training_arg")
    return model(x, training=training) if takes_training else model(x)


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any, *, training: bool) -> Any:
    """The loss Keras' train_step differentiates (`Model._compute_loss`: compiled loss + the model's losses)."""
    compute = getattr(model, "_compute_loss", None)
    if compute is None:
        raise _missing("Model._compute_loss")
    return compute(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def update_loss_tracker(model: Any, loss: Any, batch_size: Any) -> None:
    """Add this batch's loss to the model's `loss` metric, as Keras' train_step does (no-op without one)."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        unscale = _import(_UNSCALE, "unscale_loss_for_distribution")
        tracker.update_state(unscale(loss), sample_weight=batch_size)


# --------------------------------------------------------------------------------------------
# tf.data: ship a dataset made on the chief to the workers
# --------------------------------------------------------------------------------------------


def dataset_graph(dataset: Any) -> Any:
    """The dataset as a serialized GraphDef (a string tensor) a worker rebuilds with `DatasetFromGraph`.

    A dataset made on the chief lives in the chief's memory; a function run on
    a worker cannot read it, but it can rebuild it from its graph. TensorFlow
    reaches the graph only through the private `_variant_tensor`.
    """
    import tensorflow as tf

    variant = getattr(dataset, "_variant_tensor", None)
    if variant is None:
        raise _missing("tf.data.Dataset._variant_tensor")
    return tf.raw_ops.DatasetToGraphV2(input_dataset=variant, external_state_policy=0,
                                       strip_device_assignment=True)


# --------------------------------------------------------------------------------------------
# stratkit's own state on a model
# --------------------------------------------------------------------------------------------


def model_state(model: Any) -> types.SimpleNamespace:
    """stratkit's per-model cache (the PS loop, its metrics, its test function), kept on the model itself.

    One attribute of ours on the Keras object, not a `WeakKeyDictionary`: the
    cached objects hold the model, so a weak-keyed entry would keep its key
    alive forever, where the attribute's cycle is collected with the model.
    """
    state = getattr(model, _STATE, None)
    if state is None:
        state = types.SimpleNamespace(loop=None, metrics=None, test_function=None)
        setattr(model, _STATE, state)
    return state
