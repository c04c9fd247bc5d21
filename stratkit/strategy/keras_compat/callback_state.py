"""The counters Keras's own callbacks keep, read and written back for a backup (Keras 3.11-3.15.1).

A resumed run must stop, decay and save as the run it resumes: EarlyStopping's
``wait``/``best``/``best_weights``, ReduceLROnPlateau's ``wait``/``cooldown_counter``/
``best``, ModelCheckpoint's ``best`` and its ``save_freq`` counters, TensorBoard's
step axis and History's epochs live in attributes Keras sets in ``__init__``
or ``on_train_begin``; none is public API (tf-keras closed the ModelCheckpoint
case as won't-fix), so they are read and written only here, behind the gate.
LearningRateScheduler keeps nothing (its rate lives in the optimizer, which
the weights file holds); CSVLogger's rows are the training layer's business
(a file, `stratkit.training.checkpoint.callbacks_state`).

:func:`callbacks_of` finds the other callbacks of the ``fit`` a callback is
given to: Keras hands each callback only the model, so the ``CallbackList``
whose ``set_model`` is calling ours is looked up on the call stack.

State is returned as ``(values, arrays)``: JSON-able values, and numpy arrays
(EarlyStopping's best weights) kept apart for a ``.npz`` file.
"""

from __future__ import annotations

import inspect
from typing import Any

#: Per Keras callback class: the attributes that make its state (JSON-able values).
_COUNTERS: dict[str, tuple[str, ...]] = {
    "EarlyStopping": ("wait", "stopped_epoch", "best", "best_epoch"),
    "ReduceLROnPlateau": ("wait", "cooldown_counter", "best"),
    "ModelCheckpoint": ("best", "_batches_seen_since_last_saving", "_last_batch_seen", "_current_epoch"),
    "TensorBoard": ("_global_train_batch",),
    "History": ("epoch", "history"),
}


def _kind(callback: Any) -> str | None:
    import keras

    for name in _COUNTERS:
        cls = getattr(keras.callbacks, name, None)
        if cls is not None and isinstance(callback, cls):
            return name
    return None


def handles(callback: Any) -> bool:
    """True for a Keras callback whose state this module keeps."""
    return _kind(callback) is not None


def _plain(value: Any) -> Any:
    """`value` as JSON-able Python (numpy scalars and arrays to floats/lists)."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "numpy"):  # a tensor or variable (e.g. a metric value kept as best)
        return _plain(value.numpy())
    return value


def get_state(callback: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state of a Keras callback `handles` accepts: (JSON-able values, arrays)."""
    kind = _kind(callback)
    values = {name: _plain(getattr(callback, name, None)) for name in _COUNTERS.get(kind or "", ())}
    arrays: dict[str, Any] = {}
    if kind == "EarlyStopping" and getattr(callback, "best_weights", None) is not None:
        arrays = {f"best_weights/{i}": w for i, w in enumerate(callback.best_weights)}
    return values, arrays


def set_state(callback: Any, values: dict[str, Any], arrays: dict[str, Any]) -> None:
    """Put back what `get_state` returned (after the callback's own `on_train_begin` reset it)."""
    kind = _kind(callback)
    for name in _COUNTERS.get(kind or "", ()):
        if name in values:
            setattr(callback, name, values[name])
    if kind == "EarlyStopping":
        keys = sorted((k for k in arrays if k.startswith("best_weights/")), key=lambda k: int(k.split("/")[1]))
        callback.best_weights = [arrays[k] for k in keys] if keys else None
    if kind == "History":
        callback.epoch = list(values.get("epoch") or [])
        callback.history = {k: list(v) for k, v in dict(values.get("history") or {}).items()}


def callbacks_of(callback: Any) -> list[Any] | None:
    """The callbacks of the `fit` whose `CallbackList` is setting `callback`'s model, or None.

    Call it from `set_model`: Keras's `CallbackList.set_model` (called by its
    constructor, after it added History and the progress bar) is then on the stack.
    """
    import keras

    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(c is callback for c in owner.callbacks):
                return list(owner.callbacks)
        return None
    finally:
        del frame
