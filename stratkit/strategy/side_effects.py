"""Where a Keras callback's side effects land on each worker of a multi-worker run: the chief's files only once.

Every worker runs every callback (reading synchronised variables may need all
workers), but only the chief's files land where the user asked: on the other
workers, file writers write into private scratch directories
(`stratkit.strategy.scratch`, removed however the worker ends) and the progress
bar is off. Both layers apply these rules: `stratkit.Trainer.fit` (training) and
the guard for a plain `model.fit` under `make_strategy()` (`keras_compat.fit_guards`;
which models: `keras_compat.ownership`, one process too: there the one process is the
chief, and a store URL is staged and uploaded as on N workers), so they live here, in
the higher of the two. Keras is imported with this module: the guard imports it at its
first routed call, not with `stratkit`.

The user's own callback object trains on every worker, so after `fit` it holds
what it holds on one process (`ModelCheckpoint.best`, `EarlyStopping.stopped_epoch`,
a subclass's own counters). On a non-chief worker only its files move, for the
duration of `fit` (:class:`_Redirect`): every attribute that names a path under
the file's root (the attribute the user set, and the paths Keras or a subclass
derives from it, such as `BackupAndRestore`'s weights file) points into the
private directory; when `fit` ends, normally or with an exception, the attributes
it changed get their objects back and every path the callback took note of
during `fit` under the private directory (TensorBoard's run directories, a
subclass's list of saved files) names the user's place again. One mechanism for
every callback that writes files, and for subclasses of them.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import keras

from stratkit.errors import ConfigError
from stratkit.strategy import scratch, store_callbacks, store_paths
from stratkit.strategy.collectives import gather_ints
from stratkit.strategy.keras_compat.internals import resume_epoch

#: how deep `_Redirect` looks into an attribute's lists, tuples and dicts for paths
_DEPTH = 4


def _path_under(value: Any, root: str) -> str | None:
    """The part of path `value` below `root` ("" for `root` itself), or None (not a path there)."""
    if not isinstance(value, (str, os.PathLike)) or not root:
        return None
    path = os.fspath(value)
    if not isinstance(path, str):
        return None
    if path == root:
        return ""
    prefix = root if root.endswith(("/", os.sep)) else root + os.sep
    return path[len(prefix):] if path.startswith(prefix) else None


def _moved(value: Any, source: str, target: str, depth: int = _DEPTH) -> tuple[bool, Any]:
    """(changed, `value` with every path under `source` moved under `target`). Lists and dicts change in place
    (the callback may share them), tuples are rebuilt, other objects are left alone."""
    rest = _path_under(value, source)
    if rest is not None:
        moved = os.path.join(target, rest) if rest else target
        return True, (type(value)(moved) if isinstance(value, os.PathLike) else moved)
    if depth <= 0:
        return False, value
    if isinstance(value, list):
        changed = False
        for i, item in enumerate(value):
            hit, new = _moved(item, source, target, depth - 1)
            if hit:
                value[i], changed = new, True
        return changed, value
    if type(value) is tuple:      # (a named tuple is left alone)
        pairs = [_moved(item, source, target, depth - 1) for item in value]
        return (True, tuple(new for _, new in pairs)) if any(hit for hit, _ in pairs) else (False, value)
    if isinstance(value, dict):
        changed = False
        for key, item in list(value.items()):
            hit, new = _moved(item, source, target, depth - 1)
            if hit:
                value[key], changed = new, True
        return changed, value
    return False, value


@dataclass
class _Redirect:
    """One callback object of the user's whose files go to `private` instead of `root` while `fit` runs.

    `attribute` is the one the user set (`filepath`, `log_dir`, `filename`, `backup_dir`); `private_value`
    its value during `fit`. Other attributes holding a path under `root` move too (paths derived from it).
    """

    callback: Any
    attribute: str
    root: str
    private: str
    private_value: str
    saved: dict[str, Any] = field(default_factory=dict)    # attribute -> the user's object, put back at the end
    changed: dict[str, Any] = field(default_factory=dict)  # attribute -> what it was set to for fit

    def apply(self) -> None:
        state = vars(self.callback)
        for name in list(state):
            if name == self.attribute:
                continue
            original = state[name]
            if not isinstance(original, (str, os.PathLike)):
                continue        # containers are only mapped back: a copy would cut the callback's own links
            hit, new = _moved(original, self.root, self.private, 0)
            if hit:
                self._set(name, original, new)
        self._set(self.attribute, getattr(self.callback, self.attribute), self.private_value)

    def _set(self, name: str, original: Any, new: Any) -> None:
        self.saved[name], self.changed[name] = original, new
        setattr(self.callback, name, new)

    def undo(self) -> None:
        for name, value in list(vars(self.callback).items()):
            if name in self.saved and value is self.changed[name]:
                setattr(self.callback, name, self.saved[name])
                continue
            hit, new = _moved(value, self.private, self.root)
            if hit and new is not value:
                setattr(self.callback, name, new)


#: id(callback) -> its redirect, while a `fit` runs (routing the same object twice, Trainer.fit then the
#: guard in its model.fit, moves it once)
_ACTIVE: dict[int, _Redirect] = {}
#: private directory -> the redirects into it, undone by `remove_dirs`
_BY_DIR: dict[str, list[_Redirect]] = {}


def _redirect(callback: Any, temps: list[str], prefix: str, attribute: str,
              place: Callable[[Any, str, str], tuple[str, str, str]]) -> None:
    """Point `callback`'s files into a new private directory until `remove_dirs` undoes it.

    `place(callback, user_value, private_dir)` gives (the user's root, its private root, the attribute's
    private value).
    """
    temps.append(scratch.make(prefix))
    root, private, private_value = place(callback, os.fspath(getattr(callback, attribute)), temps[-1])
    redirect = _Redirect(callback, attribute, root, private, private_value)
    _BY_DIR.setdefault(temps[-1], []).append(redirect)
    _ACTIVE[id(callback)] = redirect
    redirect.apply()


def _file_in(callback: Any, user_value: str, directory: str) -> tuple[str, str, str]:
    """A file the callback names (a checkpoint, a CSV log): its directory moves, its name stays."""
    name = os.path.basename(user_value)
    return os.path.dirname(user_value), directory, os.path.join(directory, name)


def _directory_in(callback: Any, user_value: str, directory: str) -> tuple[str, str, str]:
    return user_value, directory, directory


def _backup_in(callback: Any, user_value: str, directory: str) -> tuple[str, str, str]:
    """`keras.callbacks.BackupAndRestore` starts from a copy of the chief's backup (when this worker can read
    it; from the store for a URL, as the chief reads it), so every worker resumes at the same epoch with the
    same weights, the way tf_keras's multi-worker BackupAndRestore reads the chief's files. Keras says the
    backup directory holds nothing else, so the whole directory is copied."""
    private = os.path.join(directory, "backup")
    if store_callbacks.route(callback, "") == store_paths.STORE:
        store_callbacks.pull_backup(user_value, private, "BackupAndRestore(backup_dir=...)")
    elif os.path.isdir(user_value):
        shutil.copytree(user_value, private)
    return user_value, private, private


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


#: (Keras callback class, scratch prefix, the attribute naming its files, where they go): the callbacks whose
#: files move on other workers, subclasses included (the first class that matches decides)
_ROUTES: tuple[tuple[Any, str, str, Callable[[Any, str, str], tuple[str, str, str]]], ...] = (
    (keras.callbacks.TensorBoard, "stratkit-tb-worker-", "log_dir", _directory_in),
    (keras.callbacks.ModelCheckpoint, "stratkit-ckpt-worker-", "filepath", _file_in),
    (keras.callbacks.CSVLogger, "stratkit-csv-worker-", "filename", _file_in),
    (keras.callbacks.BackupAndRestore, "stratkit-backup-worker-", "backup_dir", _backup_in),
)


def route_side_effects(callbacks: Iterable[Any], is_chief: bool, *,
                       multi_worker: bool = False) -> tuple[list[Any], list[str]]:
    """The callbacks to train with: on non-chief workers, file writers write to private temp dirs.

    Every worker still runs every callback (reading synchronised variables may
    need all workers), but only the chief's files land where the user asked
    (a store URL: written locally and uploaded whole, `stratkit.strategy.store_callbacks`).
    On other workers the user's own `TensorBoard`, `ModelCheckpoint`, `CSVLogger`
    and `BackupAndRestore` objects (and subclasses of them) train with their
    files pointed into a private temporary directory until :func:`remove_dirs`
    points them back (`BackupAndRestore` starts from a copy of the chief's backup,
    to resume at the same epoch): after `fit` each holds what it holds on one
    process. `RemoteMonitor` is left to the chief; a Keras callback whose files
    cannot be moved is refused with a `ConfigError`.

    With `multi_worker=True`, every worker (the chief too) checks after each
    `BackupAndRestore` that all workers resume at the same epoch (`AgreeOnResume`).

    Returns:
        (callbacks, temporary directories): pass the directories to :func:`remove_dirs` when `fit` ends,
        however it ends.
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
                active = _ACTIVE.get(id(callback))      # moved by Trainer.fit already: name the user's dir
                users = os.fspath(active.saved["backup_dir"] if active else callback.backup_dir)
                agreed.append(AgreeOnResume(store_callbacks.shown(callback, users)))
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
            if isinstance(callback, keras.callbacks.RemoteMonitor):
                continue  # one report per run: the chief's
            routed.append(callback)
            if id(callback) in _ACTIVE:
                continue  # already moved (by Trainer.fit, before its model.fit), or listed twice
            for kind, prefix, attribute, place in _ROUTES:
                if isinstance(callback, kind):
                    _redirect(callback, temps, prefix, attribute, place)
                    break
    except BaseException:
        remove_dirs(temps)
        raise
    return routed, temps


def remove_dirs(paths: Iterable[str]) -> None:
    """End what `route_side_effects` did: the callbacks it moved name the user's files again (their attributes
    hold the objects the user set, and a path noted during `fit` under a private directory names the user's
    place), the callbacks staged for a store point back at their URLs, and the private directories are removed
    (they go anyway when the worker ends)."""
    paths = list(paths)
    try:
        for path in paths:
            for redirect in _BY_DIR.pop(path, ()):
                _ACTIVE.pop(id(redirect.callback), None)
                redirect.undo()
        store_callbacks.restore(paths)
    finally:
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
