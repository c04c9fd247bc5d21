"""The one place Keras 3 all-reduces gradients under tf.distribute, and a hook around it.

Under ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy`` Keras 3 sums
every replica's gradients with one call, the private
``TFOptimizer._all_reduce_sum_gradients`` in
``keras/src/backend/tensorflow/optimizer.py``, which hands the whole gradient
list to ``replica_context.all_reduce(SUM, grads)``. :func:`install` wraps that
method so a hook (``stratkit.strategy.compression``'s cast to a narrower wire
type) runs around the all-reduce; :func:`self_check` says whether an untested
Keras still has the method where the wrapper expects it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from typing import Any, Callable

_OPTIMIZER_MODULE = "keras.src.backend.tensorflow.optimizer"
_METHOD = "_all_reduce_sum_gradients"
_PATCH_MARK = "__stratkit_gradient_compression__"

#: hook(all_reduce, grads_and_vars) -> reduced grads_and_vars; `all_reduce` is Keras's own method, bound.
Hook = Callable[[Callable[[Any], Any], Any], Any]

_lock = threading.Lock()
_originals: dict[str, Any] = {}


def _optimizer_class() -> Any:
    return importlib.import_module(_OPTIMIZER_MODULE).TFOptimizer


def installed() -> bool:
    """True when a hook is in place in this process."""
    try:
        return bool(getattr(_optimizer_class().__dict__.get(_METHOD), _PATCH_MARK, False))
    except ImportError:
        return False


def install(hook: Hook) -> None:
    """Route Keras's gradient all-reduce through `hook` (idempotent: a second call keeps the first hook)."""
    with _lock:
        cls = _optimizer_class()
        if getattr(cls.__dict__.get(_METHOD), _PATCH_MARK, False):
            return
        original = cls.__dict__[_METHOD]

        @functools.wraps(original)
        def all_reduce_sum_gradients(self: Any, grads_and_vars: Any) -> Any:
            return hook(functools.partial(original, self), grads_and_vars)

        setattr(all_reduce_sum_gradients, _PATCH_MARK, True)
        _originals[_METHOD] = original
        setattr(cls, _METHOD, all_reduce_sum_gradients)


def revert() -> None:
    """Restore Keras' own method (for tests, and for a bit-for-bit upstream comparison)."""
    with _lock:
        if _METHOD in _originals:
            setattr(_optimizer_class(), _METHOD, _originals.pop(_METHOD))


def self_check() -> list[str]:
    """What stops the hook from working on the installed Keras (empty: nothing).

    Fails closed. The wrapper needs ``TFOptimizer._all_reduce_sum_gradients(self,
    grads_and_vars)`` to exist, to be what ``_backend_update_step`` calls with
    the gradients, and to all-reduce them through the replica context.
    """
    problems: list[str] = []
    try:
        cls = _optimizer_class()
        method = cls.__dict__.get(_METHOD)
        method = _originals.get(_METHOD, method) if getattr(method, _PATCH_MARK, False) else method
        if method is None:
            return [f"{_OPTIMIZER_MODULE}.TFOptimizer.{_METHOD} does not exist"]
        if list(inspect.signature(method).parameters) != ["self", "grads_and_vars"]:
            problems.append(f"TFOptimizer.{_METHOD} has the signature {inspect.signature(method)}")
        if f"self.{_METHOD}(" not in inspect.getsource(cls._backend_update_step):
            problems.append(f"TFOptimizer._backend_update_step no longer calls self.{_METHOD}")
        if "all_reduce(" not in inspect.getsource(method):
            problems.append(f"TFOptimizer.{_METHOD} no longer calls replica_context.all_reduce")
    except Exception as exc:  # noqa: BLE001 - anything unexpected means "cannot verify"
        problems.append(f"self-check failed: {exc!r}")
    return problems
