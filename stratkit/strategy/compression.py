"""Compressed gradient all-reduce: ``gradient_compression=None | "bf16" | "fp16"``.

Why this exists
---------------
Under ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy`` Keras 3 sums
every replica's gradients with one call,
``TFOptimizer._all_reduce_sum_gradients`` in
``keras/src/backend/tensorflow/optimizer.py``, which hands the whole gradient
list to ``replica_context.all_reduce(SUM, grads)``. TensorFlow concatenates
that list into packs (one pack with the default ``bytes_per_pack=0``) and
runs one collective per pack. Measured on 2 workers over loopback, a float16
or bfloat16 all-reduce of the same number of values takes about half the time
of float32 (issue 16). Horovod users get this as
``compression=hvd.Compression.fp16``; Keras 3 users of tf.distribute get
nothing, so stratkit wraps that one method: dense float32 gradients are cast
to the wire type before the all-reduce and back to float32 after it. The
packing is unchanged (every gradient is still in one list, so one pack); each
pack simply carries half the bytes.

Choices
-------
* ``"bf16"`` keeps float32's exponent range (no overflow possible that float32
  would not have) and keeps 8 bits of mantissa: each gradient is rounded to
  about 3 significant digits before the sum.
* ``"fp16"`` keeps 11 bits of mantissa but overflows above 65504 (and flushes
  values below ~6e-8 to zero). It never overflows silently: after the
  all-reduce, a step whose summed gradients are not all finite is refused
  with an error that names the option and the fix, before any weight is
  updated (a control dependency gates the update). The all-reduced values are
  identical on every replica, so every worker refuses the same step; nothing
  hangs. We refuse rather than skip the step because a skipped step is not
  invisible to the optimizer (Keras still counts the iteration and momentum
  states would need their own skip), and a silently shortened training is
  the outcome this option must not produce.
* Only dense float32 gradients are cast. ``IndexedSlices`` (embedding
  gradients) are all-gathered, not all-reduced, and other dtypes are left as
  they are, so the cast never changes which pack a tensor lands in.
* With one replica in sync there is no all-reduce: nothing is cast (the option
  does nothing on ``OneDeviceStrategy`` or a one-worker MWMS).
  ``ParameterServerStrategy`` has no all-reduce either (variables live on the
  ps tasks): the option is ignored there with a log line.

Gate
----
Wrapping a private Keras method is the same kind of change as
:mod:`stratkit.strategy.keras_compat`, and sits behind the same gate: the
wrapping itself lives there (:mod:`stratkit.strategy.keras_compat.all_reduce`;
this module holds only what the hook does, with public TensorFlow), and it is
installed only when :func:`keras_compat.apply` patched Keras (a tested
version, or ``STRATKIT_KERAS_COMPAT=force``), or when a self-check of an
untested Keras 3 finds the method where the wrapper expects it. With
``STRATKIT_KERAS_COMPAT=off``, with tf-keras (Keras 2) or with a non-TF
backend, asking for compression is a :class:`~stratkit.errors.ConfigError`.

The wrapper is installed only once some strategy asks for compression, and it
reads the setting from the strategy (the attribute :data:`ATTR`, set by
:func:`configure`). A strategy without the attribute goes straight to the
original method with the original arguments: the traced graph, and so the
trained weights, are bit-for-bit what they are without stratkit.

This module imports neither TensorFlow nor Keras at import time.
"""

from __future__ import annotations

import logging
from typing import Any

from stratkit.errors import ConfigError, KerasCompatError
from stratkit.strategy.keras_compat import all_reduce as _all_reduce

__all__ = ["ATTR", "MODES", "configure", "install", "installed", "mode_of", "revert", "self_check", "validate"]

log = logging.getLogger(__name__)

#: Accepted values of ``gradient_compression`` (besides None) -> the TensorFlow dtype name on the wire.
MODES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16"}

#: Attribute stratkit sets on a strategy that should compress its gradient all-reduce.
ATTR = "stratkit_gradient_compression"

#: Marks TensorFlow's error for a refused fp16 step (no quotes: TensorFlow escapes them in its message).
OVERFLOW_MESSAGE = "stratkit gradient_compression=fp16: the all-reduced gradients are not finite"


def validate(value: Any) -> str | None:
    """``value`` if it is a valid ``gradient_compression``, else a ConfigError naming the fix."""
    if value is None or (isinstance(value, str) and value in MODES):
        return value
    raise ConfigError(
        f"gradient_compression={value!r} is not a compression mode. Fix: pass gradient_compression=None "
        f"(default: float32 all-reduce), 'bf16' (bfloat16 on the wire, float32's range) or 'fp16' (float16 on "
        f"the wire, refuses a step whose gradients overflow 65504)")


def mode_of(strategy: Any) -> str | None:
    """The compression a strategy was configured with (None: plain float32 all-reduce)."""
    return getattr(strategy, ATTR, None)


# --------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------


def _compress(grad: Any, wire: Any) -> Any:
    import tensorflow as tf

    if isinstance(grad, tf.Tensor) and grad.dtype == tf.float32:
        return tf.cast(grad, wire)
    return grad  # None, IndexedSlices, other dtypes: as upstream


def _checked_fp16(pairs: list[tuple[Any, Any]], local: list[Any]) -> list[tuple[Any, Any]]:
    """The reduced pairs, gated by an assertion that every compressed gradient is finite.

    The reduced values are the same on every replica, so every worker takes the
    same branch. The float32 gradients' own finiteness is part of the message:
    it tells an fp16 overflow from a gradient that was already inf/nan.
    """
    import tensorflow as tf

    cast = [g for (g, _), before in zip(pairs, local) if _was_compressed(before)]
    if not cast:
        return pairs
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in cast]))
    local_finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in local if _was_compressed(g)]))
    check = tf.debugging.Assert(finite, [
        f"{OVERFLOW_MESSAGE} (inf or nan after the float16 all-reduce; float16 holds at most 65504). "
        "Fix: use gradient_compression=bf16 (float32 range) or None, or make the gradients smaller "
        "(lower learning rate, clipnorm/clipvalue, a loss averaged over the batch). "
        "Float32 gradients on this worker all finite before the cast (1 = yes):", local_finite])
    with tf.control_dependencies([check]):
        return [(g if g is None else tf.identity(g), v) for g, v in pairs]


def _was_compressed(grad: Any) -> bool:
    import tensorflow as tf

    return isinstance(grad, tf.Tensor) and grad.dtype == tf.float32


def _compressed_all_reduce(all_reduce: Any, grads_and_vars: Any) -> Any:
    """The hook around Keras's gradient all-reduce: compress when the strategy asks for it.

    Without a compression mode on the current strategy (or with one replica)
    it calls Keras's all-reduce with the original arguments. Otherwise it casts
    dense float32 gradients to the wire dtype, lets Keras do the (same, packed)
    all-reduce, and casts the sums back to float32.
    """
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    mode = mode_of(context.strategy) if context is not None else None
    if mode is None or context.num_replicas_in_sync <= 1:
        return all_reduce(grads_and_vars)
    pairs = list(grads_and_vars)
    wire = tf.as_dtype(MODES[mode])
    reduced = all_reduce([(_compress(g, wire), v) for g, v in pairs])
    restored = [(tf.cast(r, g.dtype) if _was_compressed(g) else r, v) for (r, v), (g, _) in zip(reduced, pairs)]
    if mode == "fp16":
        restored = _checked_fp16(restored, [g for g, _ in pairs])
    return restored


def installed() -> bool:
    """True when the wrapper is in place in this process."""
    return _all_reduce.installed()


def install() -> None:
    """Put the wrapper in place (idempotent). Strategies without :data:`ATTR` are unaffected."""
    _all_reduce.install(_compressed_all_reduce)


def revert() -> None:
    """Restore Keras' own method (for tests, and for a bit-for-bit upstream comparison)."""
    _all_reduce.revert()


def self_check() -> list[str]:
    """What stops the wrapper from working on the installed Keras (empty: nothing); fails closed."""
    return _all_reduce.self_check()


# --------------------------------------------------------------------------
# Per-strategy configuration
# --------------------------------------------------------------------------


def configure(strategy: Any, kind: str, mode: str | None) -> None:
    """Give ``strategy`` (built for strategy ``kind``) the compression ``mode``.

    None does nothing at all (no attribute, no wrapper). For ``mirrored`` and
    ``multi_worker_mirrored`` it installs the wrapper behind the Keras gate and
    sets :data:`ATTR`; for ``parameter_server`` it logs that there is no
    all-reduce to compress; for ``one_device`` and ``tpu`` it does nothing (one
    device has nothing to all-reduce; TPU reduces inside XLA).

    Raises:
        ConfigError: a bad ``mode``, or the Keras gate is off / not Keras 3 on TensorFlow.
        KerasCompatError: an untested Keras whose optimizer the wrapper does not fit.
    """
    mode = validate(mode)
    if mode is None:
        return
    if kind == "parameter_server":
        log.warning("gradient_compression=%r is ignored with ParameterServerStrategy: workers send gradients "
                    "to the ps tasks' variables, there is no all-reduce to compress.", mode)
        return
    if kind not in ("mirrored", "multi_worker_mirrored"):
        log.info("gradient_compression=%r does nothing with strategy %r: there is no cross-replica "
                 "all-reduce of gradients to compress.", mode, kind)
        return
    _check_gate(mode)
    install()
    setattr(strategy, ATTR, mode)
    log.info("gradient_compression=%r: gradients are all-reduced as %s.", mode, MODES[mode])


def _check_gate(mode: str) -> None:
    """Install only where keras_compat would patch Keras, or an untested Keras passes the self-check."""
    from stratkit.strategy import keras_compat

    status = keras_compat.apply()
    if status in ("patched", "forced"):
        return
    if status == "disabled":
        raise ConfigError(
            f"gradient_compression={mode!r} needs stratkit's Keras patches, but {keras_compat.ENV_VAR}=off. "
            f"Fix: unset {keras_compat.ENV_VAR} (or set it to auto), or pass gradient_compression=None")
    import keras

    version = keras_compat.installed_keras_version()
    if keras_compat._major(version) < 3 or keras.backend.backend() != "tensorflow":
        raise ConfigError(
            f"gradient_compression={mode!r} works with Keras 3 on the TensorFlow backend only; this process uses "
            f"Keras {version} with the {keras.backend.backend()!r} backend. Fix: pass gradient_compression=None, "
            f"or run Keras 3 with KERAS_BACKEND=tensorflow and without TF_USE_LEGACY_KERAS")
    problems = self_check()
    if problems:
        raise KerasCompatError(
            f"gradient_compression={mode!r}: Keras {version} is not a tested version and its optimizer does not "
            f"have the shape stratkit's wrapper needs: {'; '.join(problems)}. Fix: install a tested Keras "
            f"(pip install keras=={max(keras_compat.TESTED_KERAS_VERSIONS)}) or pass gradient_compression=None")


def overflow_error(exc: BaseException) -> ConfigError | None:
    """A ConfigError for TensorFlow's error when an fp16 step was refused (None for any other error).

    ``Trainer.fit`` raises it instead of TensorFlow's ``InvalidArgumentError``
    and its traceback; a plain ``model.fit`` shows TensorFlow's error, whose
    message carries the same text.
    """
    text = str(exc)
    if OVERFLOW_MESSAGE not in text:
        return None
    tail = text[text.index(OVERFLOW_MESSAGE):]
    local = "were all finite" if "(1 = yes):] [1]" in tail else "were already not finite on this worker"
    return ConfigError(
        "training stopped before the update: gradient_compression='fp16' and the all-reduced gradients are not "
        "finite (inf or nan after the float16 all-reduce; float16 holds at most 65504). The float32 gradients "
        f"before the cast {local}. Fix: use gradient_compression='bf16' (float32's range) or None, or make the "
        "gradients smaller (lower learning rate, clipnorm/clipvalue, a loss averaged over the batch)")
