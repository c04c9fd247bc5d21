"""``float(var)`` / ``int(var)`` of a Keras variable under Mirrored / MWMS.

Cause (Keras 3.15.1, TF 2.21): Keras's ``Variable.__float__``/``__int__`` return
``float(self.value)``/``int(self.value)``. On one device ``value`` is a
``tf.Variable``, which converts; under a Mirrored/MWMS scope it is a tf.distribute
``MirroredVariable`` (or ``SyncOnReadVariable``), which defines neither, so
``float(model.optimizer.learning_rate)`` in a callback raised ``TypeError ... not
'MirroredVariable'``. The fix adds both methods to Keras's TensorFlow ``Variable``
class: for a distributed value, read eagerly, they convert the value this context
reads (``value.numpy()``: the same number one process gives); everything else
(one device, tensors, non-scalars, tracing) goes to Keras's own method unchanged.

Installed by ``keras_compat.apply`` on tested Keras versions (and with
``STRATKIT_KERAS_COMPAT=force``); on an untested one only when :func:`bug_present`
(a probe with a stand-in distributed value, no TensorFlow op) shows the bug is
still there and the classes look as the fix expects.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from stratkit.strategy.keras_compat.versions import _PATCH_MARK, TESTED_KERAS_VERSIONS

log = logging.getLogger(__name__)

_METHODS: dict[str, Callable[[Any], Any]] = {"__float__": float, "__int__": int}
_lock = threading.Lock()
_installed: set[str] = set()


def _variable_class() -> type:
    from keras.src.backend.tensorflow import core

    return core.Variable


def _scalar_method(name: str, convert: Callable[[Any], Any]) -> Any:
    inherited = getattr(_variable_class(), name)  # KerasVariable's: raises for non-scalars, converts `value`

    def method(self: Any) -> Any:
        import numpy as np
        import tensorflow as tf

        value = self.value
        if isinstance(value, tf.distribute.DistributedValues) and tf.executing_eagerly() and self.ndim == 0:
            return convert(np.asarray(value.numpy()))
        return inherited(self)

    method.__name__ = name
    setattr(method, _PATCH_MARK, True)
    return method


def install(version: str, mode: str) -> bool:
    """Add the two methods (idempotent); on an untested Keras only while :func:`bug_present`."""
    with _lock:
        if _installed:
            return True
        if version not in TESTED_KERAS_VERSIONS and mode != "force":
            try:
                _variable_class()
            except Exception:  # noqa: BLE001 - another layout: nothing to fix that we know of
                return False
            if not bug_present():
                return False
            log.info("Keras %s is untested: float()/int() of distributed variables still fail; fixing them.",
                     version)
        cls = _variable_class()
        for name, convert in _METHODS.items():
            setattr(cls, name, _scalar_method(name, convert))
            _installed.add(name)
        return True


def revert() -> None:
    """Give Keras's class its own (inherited) methods back (for tests)."""
    with _lock:
        if not _installed:
            return
        cls = _variable_class()
        for name in sorted(_installed):
            if getattr(cls.__dict__.get(name), _PATCH_MARK, False):
                delattr(cls, name)
        _installed.clear()


def bug_present() -> bool:
    """Whether ``float()``/``int()`` of a Keras variable holding a distributed value fails here.

    A stand-in: a Keras TensorFlow ``Variable`` subclass (never initialised) whose
    ``value`` is a ``tf.distribute.DistributedValues`` that converts through
    ``numpy()`` only, as ``MirroredVariable`` does. No TensorFlow op runs, so it is
    safe before MWMS starts. Fails closed: anything unexpected counts as present.
    """
    try:
        import numpy as np
        import tensorflow as tf

        class _Distributed(tf.distribute.DistributedValues):  # type: ignore[misc,valid-type]
            def numpy(self) -> Any:
                return np.float32(3.0)

        class _Probe(_variable_class()):  # type: ignore[misc]
            def __init__(self) -> None:  # deliberately no super().__init__: no TensorFlow variable
                pass

            value = property(lambda self: _Distributed())
            ndim = 0

        probe = _Probe()
        return not (float(probe) == 3.0 and int(probe) == 3)
    except Exception as exc:  # noqa: BLE001
        log.debug("keras_compat variable self-check: %r", exc)
        return True
