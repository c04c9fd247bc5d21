"""Start the epoch a resumed ``fit`` begins with at step s, not at step 0.

Keras 3's ``fit`` resumes only at epoch boundaries: ``initial_epoch`` (or the
model's ``_initial_epoch``, which ``BackupAndRestore`` sets) picks the epoch,
and every epoch runs its steps from 0 (Keras 3.15.1: the epoch loop of
``TensorFlowTrainer.fit`` iterates ``EpochIterator._enumerate_iterator``,
which yields ``(begin, end, iterator)`` for steps 0 .. steps-1; the train
function then reads one batch from ``iterator``). A step backup is written at
step s of epoch e, so its resume must run steps s .. steps-1 of epoch e.

Mechanism: ``EpochIterator._enumerate_iterator`` is wrapped. Once armed by
:func:`start_next_epoch_at` (the backup callback arms it in ``on_epoch_begin``
of the resumed epoch: the next enumeration on that thread is the epoch
``fit`` is about to run), the wrapper lets Keras's own generator run and
drops its first s tuples. Dropping a tuple reads no data (the train function
reads it), but Keras still counts those steps of the pass, so a finite
input's pass ends where it ends in an uninterrupted run. Callbacks see batch
indices s, s+1, ... (TensorBoard's step axis, ``ModelCheckpoint(save_freq=N)``
counting).

Where the data comes from: the plan says how many batches to read and throw
away first (``skip``; 0 when the input pipeline already starts at the right
batch, as ``stratkit.Trainer`` builds it), or lets this module derive it from
Keras's iterator semantics (``skip=None``, for a plain ``model.fit``): an
endless stream with ``steps_per_epoch`` (one iterator for the whole ``fit``)
skips every step ``fit`` ran before, a finite pass the steps of the current
pass. ``before`` runs before Keras starts the epoch's data (e.g. an index
offset for a ``PyDataset``).

Installed by :func:`install`, which ``stratkit.training.checkpoint`` calls
before a mid-epoch resume; inert unless armed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

_lock = threading.Lock()
_original: list[Any] = []
_armed = threading.local()


@dataclass
class EpochPlan:
    """What the next training epoch enumeration does differently.

    Attributes:
        start: the first step to run (the steps before it ran before the backup).
        skip: batches to read and drop before step `start`; None: derived from Keras's iterator
            (an endless stream with `steps_per_epoch`: `steps_before` + `start`; a finite pass: its own steps).
        steps_before: steps `fit` ran before this epoch in the run that wrote the backup (for `skip=None`).
        before: called once before the epoch's data is started.
        done: set once the plan was used (the callback checks it at the first step).
    """

    start: int
    skip: int | None = 0
    steps_before: int = 0
    before: Callable[[], None] | None = None
    done: bool = False

    def take(self) -> None:
        """Mark the plan used (by the epoch enumeration it was armed for) and run its `before`."""
        self.done = True
        if self.before is not None:
            self.before()


def _epoch_iterator_class() -> type:
    from keras.src.trainers import epoch_iterator

    return epoch_iterator.EpochIterator


def start_next_epoch_at(plan: EpochPlan) -> None:
    """Arm `plan` for the next epoch this thread enumerates (call it in `on_epoch_begin`)."""
    _armed.plan = plan


def disarm() -> None:
    """Forget an armed plan that was not used (e.g. `fit` ended before the epoch began)."""
    _armed.plan = None


def _derived_skip(iterator: Any, plan: EpochPlan) -> int:
    """Batches a fresh process must read to reach `plan.start`, as Keras's iterator reads them."""
    if iterator.steps_per_epoch and not iterator._num_batches:  # one endless stream for the whole fit
        return plan.steps_before + plan.start
    if iterator.steps_per_epoch and iterator._num_batches:  # a finite input repeated across epochs
        return (plan.steps_before + plan.start) % int(iterator._num_batches)
    return plan.start  # one pass per epoch, from a new iterator


def _enumerate_iterator(self: Any) -> Iterator[Any]:
    """Keras's enumeration, with the armed plan's first steps dropped (see the module docstring)."""
    plan = getattr(_armed, "plan", None)
    if plan is None:
        yield from _original[0](self)
        return
    _armed.plan = None
    plan.take()
    skip = _derived_skip(self, plan) if plan.skip is None else plan.skip
    positioned = False
    for begin, end, iterator in _original[0](self):
        if begin < plan.start:
            continue  # trained by the run that wrote the backup: no data is read for it
        if not positioned:
            positioned = True
            for _ in range(skip):  # the replay a pipeline that cannot be positioned needs
                next(iterator)
        yield begin, end, iterator


setattr(_enumerate_iterator, _PATCH_MARK, True)


def install() -> bool:
    """Wrap ``EpochIterator._enumerate_iterator`` (idempotent); False where this Keras has no such method."""
    with _lock:
        if _original:
            return True
        try:
            cls = _epoch_iterator_class()
            current = cls.__dict__["_enumerate_iterator"]
        except Exception:  # noqa: BLE001 - another Keras layout: no mid-epoch resume there
            log.warning("this Keras has no EpochIterator._enumerate_iterator: a mid-epoch backup cannot be resumed")
            return False
        _original.append(current)
        cls._enumerate_iterator = _enumerate_iterator
        return True


def uninstall() -> None:
    """Give Keras its method back (for tests)."""
    with _lock:
        if _original:
            _epoch_iterator_class()._enumerate_iterator = _original.pop()
