"""Where a Keras callback's side effects land on each worker of a multi-worker run: the chief's files only once.

Every worker runs every callback (reading synchronised variables may need all
workers), but only the chief's files land where the user asked: on the other
workers, file writers get private scratch directories (`stratkit.strategy.scratch`,
removed however the worker ends) and the progress bar is off. Both layers
apply these rules: `stratkit.Trainer.fit` (training) and the guard for a
plain `model.fit` under `make_strategy()` (`keras_compat.fit_guards`), so they
live here, in the higher of the two. Keras is imported with this module: the
guard imports it at its first multi-worker call, not with `stratkit`.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import weakref
from typing import Any, Iterable

import keras

from stratkit.errors import ConfigError
from stratkit.strategy import scratch, store_callbacks, store_paths
from stratkit.strategy.collectives import gather_ints
from stratkit.strategy.keras_compat.internals import resume_epoch

#: Callback copies stratkit made for a non-chief worker (they already write privately).
_PRIVATE_COPIES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _private_copy(callback: Any, temps: list[str], prefix: str, attribute: str, value: Any) -> Any:
    """A shallow copy of `callback` whose `attribute` points into a new private temp dir.

    The user's object is left as it was made, so a later `fit`, and the chief's
    files, are unaffected. `value(temp_dir)` gives the new attribute value.
    """
    temps.append(scratch.make(prefix))
    private = copy.copy(callback)
    setattr(private, attribute, value(temps[-1]))
    _PRIVATE_COPIES.add(private)
    return private


def _private_backup(callback: Any, temps: list[str]) -> Any:
    """A non-chief copy of `keras.callbacks.BackupAndRestore` that writes to a private dir.

    It starts from a copy of the chief's backup (when this worker can read it),
    so every worker resumes at the same epoch with the same weights, the way
    tf_keras's multi-worker BackupAndRestore reads the chief's files. Keras says
    the backup directory holds nothing else, so the whole directory is copied.
    """
    temps.append(scratch.make("stratkit-backup-worker-"))
    private_dir = os.path.join(temps[-1], "backup")
    source = os.fspath(callback.backup_dir)
    if store_callbacks.route(callback, "") == store_paths.STORE:   # read back from the store, as the chief does
        store_callbacks.pull_backup(source, private_dir, "BackupAndRestore(backup_dir=...)")
    elif os.path.isdir(source):
        shutil.copytree(source, private_dir)
    private = copy.copy(callback)
    # The public constructor re-derives every path from backup_dir; the rest of the copy is kept.
    store_callbacks.reinit_backup(private, private_dir)
    _PRIVATE_COPIES.add(private)
    return private


def _refuse_unroutable(callback: Any) -> None:
    orbax = getattr(keras.callbacks, "OrbaxCheckpoint", None)
    if orbax is not None and isinstance(callback, orbax):
        raise ConfigError(f"callbacks=[{type(callback).__name__}(...)] would write the same checkpoint directory "
                          "from every worker, and stratkit cannot give the other workers a private one. Fix: use "
                          "keras.callbacks.ModelCheckpoint or keras.callbacks.BackupAndRestore (stratkit routes "
                          "them), or stratkit.Trainer(...).fit(backup_dir=...)")


class AgreeOnResume(keras.callbacks.Callback):
    """Stop every worker before training if they would resume at different epochs.

    Runs right after a `BackupAndRestore` on every worker of a multi-worker run.
    A worker that cannot read the chief's backup (not on shared storage, or
    removed by the end of a previous `fit`) would start from other weights and
    another epoch: training would be wrong, then hang. One small collective per
    `fit` turns that into a clear error on every worker.
    """

    def __init__(self, backup_dir: str) -> None:
        super().__init__()
        self.backup_dir = backup_dir

    def on_train_begin(self, logs: dict | None = None) -> None:
        epochs = gather_ints(self.model.distribute_strategy, resume_epoch(self.model))
        if min(epochs) != max(epochs):
            raise ConfigError(f"BackupAndRestore(backup_dir={self.backup_dir!r}): the workers would resume at "
                              f"different epochs {epochs} (one per worker, chief first): some worker cannot read "
                              "the chief's backup. Fix: keep backup_dir on storage every worker can read, and use "
                              "a new backup_dir for each model.fit call (or delete it to start over)")


def route_side_effects(callbacks: Iterable[Any], is_chief: bool, *,
                       multi_worker: bool = False) -> tuple[list[Any], list[str]]:
    """The callbacks to train with: on non-chief workers, file writers write to private temp dirs.

    Every worker still runs every callback (reading synchronised variables may
    need all workers), but only the chief's files land where the user asked
    (a store URL: written locally and uploaded whole, `stratkit.strategy.store_callbacks`).
    On other workers `TensorBoard`, `ModelCheckpoint`, `CSVLogger` and
    `BackupAndRestore` are replaced by copies that write to a private temporary
    directory (`BackupAndRestore` starts from a copy of the chief's backup, to
    resume at the same epoch); `RemoteMonitor` is left to the chief; a Keras
    callback whose files cannot be moved is refused with a `ConfigError`.

    With `multi_worker=True`, every worker (the chief too) checks after each
    `BackupAndRestore` that all workers resume at the same epoch (`AgreeOnResume`).

    Returns:
        (callbacks, temporary directories to remove after training).
    """
    callbacks = list(callbacks or ())
    for callback in callbacks:  # on every worker, so that all of them stop before training
        _refuse_unroutable(callback)
        store_callbacks.route(callback, "")   # a URL nothing opens, or "s3:/b" (a directory "s3:"): ConfigError
    if multi_worker:
        agreed: list[Any] = []
        for callback in callbacks:
            agreed.append(callback)
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                agreed.append(AgreeOnResume(store_callbacks.shown(callback, os.fspath(callback.backup_dir))))
        callbacks = agreed
    routed: list[Any] = []
    temps: list[str] = []
    if is_chief:  # the user's files: a store URL is written locally and uploaded (`store_callbacks`)
        try:
            for callback in callbacks:
                routed.extend(store_callbacks.to_store(callback, temps))
        except BaseException:
            remove_dirs(temps)
            raise
        return routed, temps
    try:
        for callback in callbacks:
            if callback in _PRIVATE_COPIES or isinstance(callback, AgreeOnResume):
                routed.append(callback)
            elif isinstance(callback, keras.callbacks.TensorBoard):
                routed.append(_private_copy(callback, temps, "stratkit-tb-worker-", "log_dir", lambda d: d))
            elif isinstance(callback, keras.callbacks.ModelCheckpoint):
                name = os.path.basename(str(callback.filepath))
                routed.append(_private_copy(callback, temps, "stratkit-ckpt-worker-", "filepath",
                                            lambda d: os.path.join(d, name)))
            elif isinstance(callback, keras.callbacks.CSVLogger):
                name = os.path.basename(str(callback.filename))
                routed.append(_private_copy(callback, temps, "stratkit-csv-worker-", "filename",
                                            lambda d: os.path.join(d, name)))
            elif isinstance(callback, keras.callbacks.BackupAndRestore):
                routed.append(_private_backup(callback, temps))
            elif isinstance(callback, keras.callbacks.RemoteMonitor):
                continue  # one report per run: the chief's
            else:
                routed.append(callback)
    except BaseException:
        remove_dirs(temps)
        raise
    return routed, temps


def remove_dirs(paths: Iterable[str]) -> None:
    """Remove the private directories `route_side_effects` made (they go anyway when the worker ends), and
    point the callbacks staged for a store back at their URLs."""
    paths = list(paths)
    store_callbacks.restore(paths)
    scratch.remove(paths)


def default_verbose(is_chief: bool) -> Any:
    """Progress bar on the chief ("auto": a bar on a terminal, a line per epoch in logs); workers quiet.

    `STRATKIT_VERBOSE_WORKERS=1` shows every worker's. Used by `Trainer.fit` and,
    for a plain `model.fit` under `make_strategy()`, by the guard in
    `stratkit.strategy.keras_compat.fit_guards` (an explicit `verbose=` always wins).
    """
    if not is_chief and os.environ.get("STRATKIT_VERBOSE_WORKERS", "") not in ("1", "true", "yes"):
        return 0
    return 1 if sys.stdout.isatty() else 2
