"""float8 training (``model.quantize("float8")``, then ``fit``) on N > 1 replicas: one process's numbers.

Keras's float8 layers (``Dense``/``EinsumDense``) differ from a plain layer in
three places that a sum of the replicas' gradients gets wrong; each is set
right here, for :mod:`.global_gradient`:

1. **Scales and amax histories** are trainable variables whose "gradient" is
   their next value (``variable.overwrite_with_gradient``), which the optimizer
   assigns. The scale is computed from the history alone (equal on every
   replica); the history's newest entry is the largest absolute value the
   replica saw (its inputs, or its rows' output gradients). One process sees the
   global batch, so its entry is the largest over every replica's: the
   elementwise maximum of the replicas' new values is exactly one process's,
   where the mean the all-reduce gave is not (measured: a history entry 0.158
   where one process has 0.085). Keras itself combines such values of a batch's
   parts with a maximum when it accumulates gradients. :func:`agreed`: one
   ``all_gather`` per dtype, only for a model that has such variables.
2. **The output gradients** a layer records are one process's only at one
   process's per-row size: in ``fit`` a replica's loss reads N x its share
   (:mod:`.global_gradient`, 3), so for an optimizer with such variables
   (:func:`present`) the loss is divided by N before the backward pass, as a loss
   scale is. A custom ``train_step`` that never calls ``optimizer.scale_loss`` is
   refused before its first step (:func:`unscaled_refusal`).
3. **The bias** is added through a bfloat16 round trip when the layer computes
   in float32 (Keras's choice, for a fused bias add on GPUs); its gradient takes
   the same round trip, so each replica's part of the bias gradient was rounded
   to bfloat16 before the sum (measured: biases 1e-5 to 1e-4 from one process
   after one step, every other weight within 3e-8). On N replicas the layer adds
   the same bias value with a gradient left in float32 (:func:`float8_call`),
   and the summed gradient is rounded to bfloat16 as one process rounds its own
   (:func:`rounded`).

Installed with :mod:`.global_gradient` (its ``install``), on tested Keras versions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from stratkit.errors import ConfigError
from stratkit.strategy.keras_compat.replicas import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

#: the layers whose ``_float8_call`` adds its bias through a bfloat16 round trip
LAYERS = (("keras.src.layers.core.dense", "Dense"), ("keras.src.layers.core.einsum_dense", "EinsumDense"))
#: set on a float8 layer's bias variable: its summed gradient is rounded to bfloat16 (3.)
_BF16_GRADIENT = "_stratkit_float8_bias"


def is_overwritten(variable: Any) -> bool:
    """True for a variable the optimizer overwrites with its "gradient" (Keras's float8 scales and histories)."""
    return getattr(variable, "overwrite_with_gradient", False) is True


def present(optimizer: Any) -> bool:
    """True when a built `optimizer` trains variables it overwrites with their new values."""
    variables = getattr(optimizer, "_trainable_variables", None) if getattr(optimizer, "built", False) else None
    return any(is_overwritten(v) for v in variables or ())


def agreed(grads: list[Any], variables: list[Any]) -> list[Any]:
    """In a replica context: `grads` with every new value of an overwritten variable replaced by its elementwise
    maximum over the replicas (one all_gather per dtype); `grads` itself when there is none (no op added)."""
    picked = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and is_overwritten(v)]
    if not picked:
        return grads
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    values = {i: tf.convert_to_tensor(grads[i]) for i in picked}
    by_dtype: dict[Any, list[int]] = {}
    for i in picked:
        by_dtype.setdefault(values[i].dtype, []).append(i)
    out = list(grads)
    for indices in by_dtype.values():
        flat = tf.concat([tf.reshape(values[i], [-1]) for i in indices], axis=0)
        largest = tf.reduce_max(context.all_gather(flat[tf.newaxis], axis=0), axis=0)
        parts = tf.split(largest, [int(values[i].shape.num_elements()) for i in indices])
        for i, part in zip(indices, parts):
            out[i] = tf.reshape(part, values[i].shape)
    return out


def rounded(grads: list[Any], variables: list[Any]) -> list[Any]:
    """`grads` with a float8 layer's bias gradient rounded to bfloat16 and back, as one process's backward pass
    rounds it (3.); `grads` itself when there is none."""
    marked = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and getattr(v, _BF16_GRADIENT,
                                                                                                False)]
    if not marked:
        return grads
    import tensorflow as tf

    out = list(grads)
    for i in marked:
        out[i] = tf.cast(tf.cast(tf.convert_to_tensor(grads[i]), tf.bfloat16), grads[i].dtype)
    return out


def unscaled_refusal(optimizer: Any, grads: list[Any], variables: list[Any], replicas: int) -> ConfigError | None:
    """The error for a step in ``fit`` whose overwritten variables got values at N times one process's output
    gradients (the step's loss never passed through ``optimizer.scale_loss``), else None."""
    names = [getattr(v, "path", getattr(v, "name", "?")) for g, v in zip(grads, variables)
             if g is not None and is_overwritten(v)]
    if not names:
        return None
    return ConfigError(
        f"{type(optimizer).__name__} trains float8 state ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: "
        f"variables Keras overwrites with their new value) in a train_step whose loss never passed through "
        f"optimizer.scale_loss: on {replicas} replicas its output gradients, and the amax histories recorded "
        f"from them, would be {replicas} times one process's. Fix: in train_step, write "
        f"loss = self.optimizer.scale_loss(loss) before tape.gradient(loss, ...), as Keras's own train_step "
        f"does (without a loss scale it changes nothing on one process)")


def _bias_with_float32_gradient(bias: Any) -> Any:
    """The bias's bfloat16 round trip as Keras computes it, with the gradient passed on in float32.

    ``bias + stop_gradient(q - bias)`` is exactly ``q``: ``q`` is ``bias`` rounded, so ``q - bias`` is exact
    (Sterbenz) and adding it back gives ``q``."""
    from keras.src import ops

    value = ops.convert_to_tensor(bias)
    trip = ops.cast(ops.cast(value, "bfloat16"), value.dtype)
    return ops.add(value, ops.stop_gradient(ops.subtract(trip, value)))


def float8_call(original: Any) -> Any:
    """``Dense``/``EinsumDense._float8_call`` on N replicas, computing in float32: the layer's own matmul, then
    the bias and the activation as Keras adds them, the bias's gradient unrounded (3.)."""
    @functools.wraps(original)
    def call(self: Any, inputs: Any, training: Any = None) -> Any:
        bias, activation = self.bias, self.activation
        if bias is None or not sync_replicas() or self.dtype_policy.compute_dtype != "float32":
            return original(self, inputs, training=training)
        from keras.src import ops

        # Replica threads take turns between collectives and the forward pass has none: hiding the bias and the
        # activation for the length of this call is seen by no other replica
        object.__setattr__(self, "bias", None)
        object.__setattr__(self, "activation", None)
        try:
            x = original(self, inputs, training=training)
        finally:
            object.__setattr__(self, "bias", bias)
            object.__setattr__(self, "activation", activation)
        object.__setattr__(bias, _BF16_GRADIENT, True)
        x = ops.add(x, _bias_with_float32_gradient(bias))
        return activation(x) if activation is not None else x

    setattr(call, _PATCH_MARK, True)
    return call


def targets() -> list[tuple[Any, str, str, Any]]:
    """For :mod:`.global_gradient`'s install: (owner, attribute, key, replacement factory)."""
    out = []
    for module, name in LAYERS:
        out.append((getattr(importlib.import_module(module), name), "_float8_call", f"{name}._float8_call",
                    float8_call))
    return out


def self_check() -> list[str]:
    """What stops this from being right on the installed Keras (empty: nothing)."""
    problems: list[str] = []
    try:
        base = importlib.import_module("keras.src.optimizers.base_optimizer").BaseOptimizer
        source = inspect.getsource(base.apply)
        if not (0 <= source.find("_filter_empty_gradients(") < source.find("_overwrite_variables_directly_with")):
            problems.append("BaseOptimizer.apply no longer drops None gradients, then assigns "
                            "overwrite_with_gradient variables")
        for module, name in LAYERS:
            layer = getattr(importlib.import_module(module), name)
            call = layer.__dict__.get("_float8_call")
            call = getattr(call, "__wrapped__", call)
            tail = inspect.getsource(call).split("bias = self.bias", 1)[-1]
            if 'ops.cast(bias, "bfloat16")' not in tail or "self.activation(x)" not in tail:
                problems.append(f"{name}._float8_call no longer adds its bias through bfloat16, then the activation")
    except Exception as exc:  # noqa: BLE001 - anything unexpected means "cannot verify"
        problems.append(f"self-check failed: {exc!r}")
    return problems
