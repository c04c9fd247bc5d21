"""Callbacks' state in a backup: who takes part, under which key, and CSVLogger's rows.

Taking part:

* Keras's EarlyStopping, ReduceLROnPlateau, ModelCheckpoint (best value,
  `save_freq` counters), TensorBoard (its step axis) and History (the epochs
  so far): their counters are read and written back behind the gate
  (`stratkit.strategy.keras_compat.callback_state`);
* any callback with `get_state()` -> dict and `set_state(dict)`: stratkit's own
  (`LinearScalingWarmup`, `Throughput`) and the user's. The dict must be
  JSON-able (numbers, strings, lists, dicts);
* LearningRateScheduler keeps nothing: its rate is in the optimizer (the backup has it);
* CSVLogger: a resumed run appends to the file (it would start it again), and
  the rows of the epochs after the backup's are dropped first, so no row repeats.

Callbacks are matched by class name and order (`EarlyStopping`, `EarlyStopping#2`):
the resumed script must pass the same callbacks.
"""

from __future__ import annotations

import csv
import io
import os
import stat
from typing import Any, Iterable

import keras

from stratkit import files, status
from stratkit.strategy.keras_compat import callback_state as keras_state

log = status.logger(__name__)


def _keys(callbacks: Iterable[Any]) -> list[tuple[str, Any]]:
    """(key, callback) for every callback, keyed by class name and its count so far."""
    seen: dict[str, int] = {}
    keyed = []
    for callback in callbacks:
        name = type(callback).__name__
        seen[name] = seen.get(name, 0) + 1
        keyed.append((name if seen[name] == 1 else f"{name}#{seen[name]}", callback))
    return keyed


def _own(callback: Any) -> bool:
    """A callback with its own `get_state`/`set_state` (stratkit's or the user's)."""
    return callable(getattr(callback, "get_state", None)) and callable(getattr(callback, "set_state", None))


def collect(callbacks: Iterable[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every taking-part callback's state: ({key: JSON-able state}, {"key/name": array})."""
    values: dict[str, Any] = {}
    arrays: dict[str, Any] = {}
    for key, callback in _keys(callbacks):
        if _own(callback) and not keras_state.handles(callback):
            state = callback.get_state()
            if not isinstance(state, dict):
                raise TypeError(f"{type(callback).__name__}.get_state() returned {type(state).__name__}, not a dict")
            values[key] = state
        elif keras_state.handles(callback):
            state, parts = keras_state.get_state(callback)
            values[key] = state
            arrays.update({f"{key}/{name}": value for name, value in parts.items()})
    return values, arrays


def restore(callbacks: Iterable[Any], values: dict[str, Any], arrays: dict[str, Any]) -> list[str]:
    """Give each taking-part callback its saved state; returns the keys the backup has but this run does not."""
    used = set()
    for key, callback in _keys(callbacks):
        if key not in values:
            continue
        used.add(key)
        if _own(callback) and not keras_state.handles(callback):
            callback.set_state(values[key])
        elif keras_state.handles(callback):
            prefix = f"{key}/"
            keras_state.set_state(callback, values[key],
                                  {name[len(prefix):]: value for name, value in arrays.items()
                                   if name.startswith(prefix)})
    return sorted(set(values) - used)


def continue_csv_logs(callbacks: Iterable[Any], epoch: int) -> list[Any]:
    """Make every CSVLogger append, after dropping its rows of epochs >= `epoch` (0-based); returns them.

    Call it before the CSVLoggers' own `on_train_begin` (they open the file
    there). Each one's `append` is set; `restore_csv_append` puts it back.
    """
    loggers = [c for c in callbacks if isinstance(c, keras.callbacks.CSVLogger)]
    for logger in loggers:
        logger._stratkit_append = logger.append
        logger.append = True
        try:
            _drop_rows_from(str(logger.filename), epoch, logger.sep)
        except OSError as exc:
            log.warning("could not drop the rows after epoch %d from %s (%s): rows may repeat", epoch,
                        logger.filename, exc.strerror or exc)
    return loggers


def restore_csv_append(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        if hasattr(logger, "_stratkit_append"):
            logger.append = logger._stratkit_append
            del logger._stratkit_append


def _drop_rows_from(path: str, epoch: int, separator: str) -> None:
    """Rewrite the CSV at `path` (atomically, its mode kept) without the rows whose epoch is >= `epoch`."""
    if not os.path.isfile(path):
        return
    with open(path, newline="") as handle:
        text = handle.read()
    rows = list(csv.reader(io.StringIO(text), delimiter=separator))
    if not rows or rows[0][:1] != ["epoch"]:
        return  # not a CSVLogger file we know: leave it
    kept = [rows[0]] + [row for row in rows[1:] if row and _epoch_of(row) < epoch]
    if len(kept) == len(rows):
        return
    out = io.StringIO()
    csv.writer(out, delimiter=separator, lineterminator="\r\n").writerows(kept)  # Keras writes the excel dialect
    mode = stat.S_IMODE(os.stat(path).st_mode)
    files.write_bytes(path, out.getvalue().encode())
    os.chmod(path, mode)


def _epoch_of(row: list[str]) -> float:
    try:
        return float(row[0])
    except ValueError:
        return float("inf")
