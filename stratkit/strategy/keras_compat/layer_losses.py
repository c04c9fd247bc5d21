"""Losses a layer adds in ``call`` (``add_loss``, activity regularizers): each replica reads its own.

Cause (Keras 3.15.1, TF 2.21): a layer keeps the losses it adds in one list
on the layer (``Layer._losses``). MirroredStrategy runs every replica's step
in its own thread over the same layer objects, one thread at a time, switching
at each ``merge_call``; each thread clears the model's lists when it enters the
model's call. A replica that pauses at a ``merge_call`` between its forward
pass and ``compute_loss``'s read of ``model.losses`` (stratkit's count
all-reduce in the loss, the exact BatchNorm moments, any all-reduce in a
user's step) lets the next replica clear the lists and fill them with its
own tensors; the first replica then trains on the other replica's added
losses. Measured on Mirrored over 2 logical CPUs, ``Dense(...,
activity_regularizer=l2(0.5))`` and a layer calling ``add_loss``: weights
4.7e-2 away from one process (Keras alone, with no pause there, was exact).

Fix: in a replica context of a Mirrored/MWMS strategy with N > 1 replicas,
``add_loss``, the read and the clearing use a list per layer and per thread;
everywhere else (one device, eager calls, Keras's stateless scope) Keras's
own list, unchanged. Keras's own list still receives the losses of each
process's first replica (and only them), so ``model.losses`` read between
steps or after ``fit`` lists what one process lists (it listed only the weight
regularizers before). Installed with :mod:`.global_gradient`, which makes the
pause.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from stratkit.strategy.keras_compat.replicas import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

_METHODS = ("add_loss", "_get_own_losses", "_clear_losses")
_lock = threading.Lock()
_originals: dict[str, Any] = {}
_per_layer: "weakref.WeakKeyDictionary[Any, threading.local]" = weakref.WeakKeyDictionary()


def _layer_class() -> type:
    from keras.src.layers import layer

    return layer.Layer


def _replica_losses(layer: Any) -> list[Any] | None:
    """This replica thread's list for `layer`, or None where Keras's own list is right."""
    from keras.src import backend

    if backend.in_stateless_scope() or not sync_replicas():
        return None
    with _lock:
        local = _per_layer.get(layer)
        if local is None:
            local = _per_layer[layer] = threading.local()
    return vars(local).setdefault("losses", [])     # this thread's view of the threading.local


_first = threading.local()      # per replica thread: (its replica context, whether it is the first)


def _first_local_replica() -> bool:
    """True in this process's first replica thread: the one whose losses Keras's own list keeps.

    Read once per replica context (once per replica per trace): in a graph, every read of
    ``replica_id_in_sync_group`` adds a node, and this is asked for every layer.
    """
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    known = getattr(_first, "entry", None)
    if known is not None and known[0] is context:
        return known[1]
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    devices = len(tf.distribute.get_strategy().extended.worker_devices) or 1
    first = replica is not None and int(replica) % devices == 0
    _first.entry = (context, first)
    return first


def add_loss(self: Any, loss: Any) -> None:
    mine = _replica_losses(self)
    if mine is None:
        return _originals["add_loss"](self, loss)
    own = self._losses
    before = len(own)
    _originals["add_loss"](self, loss)       # Keras's checks; it appends to the shared list...
    mine.extend(own[before:])                  # ...which this thread alone runs now: its own gets them...
    if not _first_local_replica():             # ...and the shared list keeps the first replica's only, so
        del own[before:]                       # model.losses outside a step lists one process's losses


def _get_own_losses(self: Any) -> list[Any]:
    mine = _replica_losses(self)
    return _originals["_get_own_losses"](self) if mine is None else list(mine)


def _clear_losses(self: Any) -> None:
    mine = _replica_losses(self)
    if mine is None or _first_local_replica():
        if mine is not None:
            mine.clear()
        return _originals["_clear_losses"](self)   # the shared list, and every sublayer (through this method)
    mine.clear()
    for layer in self._layers:                # another replica: its own lists only, the first one's stay
        layer._clear_losses()


for _function in (add_loss, _get_own_losses, _clear_losses):
    setattr(_function, _PATCH_MARK, True)
_REPLACEMENTS = {"add_loss": add_loss, "_get_own_losses": _get_own_losses, "_clear_losses": _clear_losses}


def missing() -> list[str]:
    """The methods this fix wraps that the installed Keras's Layer lacks (empty: it can be installed)."""
    try:
        cls = _layer_class()
    except Exception:  # noqa: BLE001 - another layout
        return list(_METHODS)
    return [name for name in _METHODS if not callable(cls.__dict__.get(name))]


def install() -> None:
    """Wrap the three methods (idempotent); on a Keras whose Layer lacks one, say so and leave Keras's."""
    gone = missing()
    if gone:
        log.warning("this Keras's Layer has no %s: losses a layer adds in call() (add_loss, activity "
                    "regularizers) may be read by the wrong replica under MirroredStrategy with several devices.",
                    ", ".join(gone))
        return
    with _lock:
        cls = _layer_class()
        for name in _METHODS:
            current = cls.__dict__[name]
            if not getattr(current, _PATCH_MARK, False):
                _originals[name] = current
                setattr(cls, name, _REPLACEMENTS[name])


def uninstall() -> None:
    """Give Keras its methods back (for tests)."""
    with _lock:
        cls = _layer_class()
        for name in list(_originals):
            setattr(cls, name, _originals.pop(name))
