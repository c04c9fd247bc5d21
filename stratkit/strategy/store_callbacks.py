"""The file-writing Keras callbacks stratkit routes, given a store URL: written locally, uploaded whole.

Keras's `ModelCheckpoint`, `CSVLogger`, `TensorBoard` and `BackupAndRestore`
write local files as they go (Keras sends a URL to ``tf.io.gfile``, which
reaches ``gs://`` only). When their path is a store URL that fsspec opens
(`stratkit.strategy.store_paths`), on the worker that writes the run's files:

* the callback's path is pointed, for this `fit`, at a private local staging
  directory (`stratkit.strategy.scratch`), and a `StoreSync` right after it
  uploads each file that changed, whole, at every epoch's end (at every batch's
  end for a `save_freq` in batches), and everything at the end of training
  (`stratkit.storage.Mirror`); the path is set back at the end of `fit`;
* the store is probed first: a missing bucket, refused credentials or a store
  that does not answer are a `ConfigError` before step 1;
* `BackupAndRestore` first reads its backup back from the store (the pair of
  weights and epoch the last complete upload committed, `Mirror`'s manifest),
  and so does every other worker into its private copy, so every worker resumes
  at the same epoch with the same weights; `CSVLogger(append=True)` reads its
  file back.

A failed upload during training is a warning (the file is uploaded at the next
epoch's end); the one at the end of training is tried again a few times, then
raised, so a file that never reached the store is never silently lost.
TensorBoard's event files are uploaded as far as TensorFlow has flushed them
(its writers flush every 2 minutes and when training ends).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import keras

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.storage.mirror import Mirror
from stratkit.strategy import scratch, store_paths
from stratkit.strategy.keras_compat import save_guards

log = logging.getLogger(__name__)

#: BackupAndRestore's files, read together: uploaded after the others (its .bkp copies go first).
BACKUP_FILES = ("latest.weights.h5", "training_metadata.json")
#: Seconds between the tries of the final upload.
FINAL_TRIES = (1.0, 2.0, 4.0)

#: staging directory -> how to point its callback back at the user's URL (run by `restore`).
_RESTORE: dict[str, Callable[[], None]] = {}
#: callback -> the URL the user gave (while its path points at a staging directory).
_SHOWN: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def path_of(callback: Any) -> tuple[str, str] | None:
    """(attribute, path) of a callback stratkit routes; None for any other callback."""
    for kind, attribute in ((keras.callbacks.TensorBoard, "log_dir"), (keras.callbacks.ModelCheckpoint, "filepath"),
                            (keras.callbacks.CSVLogger, "filename"), (keras.callbacks.BackupAndRestore, "backup_dir")):
        if isinstance(callback, kind):
            return attribute, os.fspath(getattr(callback, attribute))
    return None


def shown(callback: Any, path: str) -> str:
    """The path to name in messages about `callback`: the user's URL while a staging directory stands in."""
    return storage.redact(_SHOWN.get(callback, path))


def route(callback: Any, what: str) -> str:
    """`store_paths.route` for the callback's path (`LOCAL` for a callback stratkit does not route)."""
    found = path_of(callback)
    if found is None:
        return store_paths.LOCAL
    return store_paths.route(found[1], f"{type(callback).__name__}({found[0]}=...) {what}".strip())


def _split_template(url: str) -> tuple[str, str]:
    """(store root, relative path) of a ModelCheckpoint URL: the root ends before the first part holding a
    ``{...}`` field (``s3://b/run/{epoch}/m.keras`` -> ``s3://b/run``, ``{epoch}/m.keras``)."""
    scheme, rest = url.split("://", 1)
    parts = rest.split("/")
    first = next((i for i, part in enumerate(parts) if "{" in part), len(parts) - 1)
    first = max(first, 1)   # the bucket stays in the root
    return f"{scheme}://" + "/".join(parts[:first]), "/".join(parts[first:])


def reinit_backup(callback: Any, backup_dir: str) -> None:
    """Point a `BackupAndRestore` at `backup_dir` through its public constructor (it derives every path from
    it), keeping its options."""
    keras.callbacks.BackupAndRestore.__init__(callback, backup_dir, save_freq=callback.save_freq,
                                              double_checkpoint=callback.double_checkpoint,
                                              delete_checkpoint=callback.delete_checkpoint)


def pull_backup(url: str, local_dir: str, what: str) -> list[str]:
    """Download the `BackupAndRestore` backup at `url` into `local_dir` (the pair its last upload committed).

    Raises:
        ConfigError: the store cannot be read (credentials, a missing bucket, unreachable).
    """
    try:
        mirror = Mirror(local_dir, storage.open_store(url, what), manifest=True, last=BACKUP_FILES)
        return mirror.pull()
    except storage.StoreError as exc:
        raise ConfigError(f"{what}={storage.redact(url)!r}: could not read the backup back ({exc}). Fix: give "
                          "every worker of the cluster read access to this store (its credentials and endpoint in "
                          "their environment), or pass a new backup_dir") from None


def to_store(callback: Any, temps: list[str]) -> list[Any]:
    """On the worker that writes the run's files: `[callback, StoreSync]` for a callback whose path is a store
    URL fsspec opens (the callback pointed at a staging directory appended to `temps`), else `[callback]`.

    Raises:
        ConfigError: the URL's store cannot be written (probed before training), or its filesystem is missing.
    """
    found = path_of(callback)
    if found is None or route(callback, "") != store_paths.STORE:
        return [callback]
    attribute, url = found
    what = f"{type(callback).__name__}({attribute}=...)"
    staging = scratch.make("stratkit-store-staging-")
    temps.append(staging)
    every_batch = False
    pull: list[str] | None = []
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        root, local = url, os.path.join(staging, "backup")
        mirror = Mirror(local, storage.check_store(root, what), manifest=True, last=BACKUP_FILES)
        every_batch, pull = isinstance(callback.save_freq, int), None
    elif isinstance(callback, keras.callbacks.ModelCheckpoint):
        root, relative = _split_template(url)
        local = os.path.join(staging, *relative.split("/"))
        mirror = Mirror(staging, storage.check_store(root, what))
        every_batch = callback.save_freq != "epoch"
    elif isinstance(callback, keras.callbacks.CSVLogger):
        root, name = url.rstrip("/").rsplit("/", 1)
        local = os.path.join(staging, name)
        mirror = Mirror(staging, storage.check_store(root, what))
        pull = [name] if callback.append else []
    else:  # TensorBoard
        root, local = url, staging
        mirror = Mirror(staging, storage.check_store(root, what))
    if pull is None or pull:
        try:
            mirror.pull(pull)
        except storage.StoreError as exc:
            raise ConfigError(f"{what}={storage.redact(url)!r}: could not read what it holds ({exc}). Fix: check "
                              "the store's credentials and endpoint") from None
    _point(callback, attribute, local, url, staging, root)
    sync = (StoreSyncEveryBatch if every_batch else StoreSync)(mirror, staging)
    return [callback, sync]


def _point(callback: Any, attribute: str, local: str, url: str, staging: str, root: str) -> None:
    """Point `callback` at `local` until `restore(staging)`; what Keras prints names the URL meanwhile."""
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        reinit_backup(callback, local)
        put_back = functools.partial(reinit_backup, callback, url)
    else:
        setattr(callback, attribute, local)
        put_back = functools.partial(setattr, callback, attribute, url)
    mirrored = local if isinstance(callback, keras.callbacks.BackupAndRestore) else staging
    save_guards.name_in_messages(mirrored, root)

    def restore_one() -> None:
        put_back()
        save_guards.name_in_messages(mirrored, None)

    _RESTORE[staging] = restore_one
    _SHOWN[callback] = url


def restore(staging_dirs: list[str] | tuple[str, ...] | set[str]) -> None:
    """Point the callbacks staged in `staging_dirs` back at their URLs (idempotent; at the end of `fit`)."""
    for directory in staging_dirs:
        action = _RESTORE.pop(directory, None)
        if action is not None:
            action()


class StoreSync(keras.callbacks.Callback):
    """Right after a staged callback: its new files uploaded at each epoch's end, all of them at the end.

    Args:
        mirror: the staging directory and its store prefix.
        staging: the staging directory (the key `restore` takes).
    """

    def __init__(self, mirror: Mirror, staging: str) -> None:
        super().__init__()
        self.mirror = mirror
        self.staging = staging

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mirror.store!r})"

    def _push(self) -> None:
        try:
            self.mirror.push()
        except OSError as exc:     # StoreError, or a file the writer removed meanwhile: the next push retries
            log.warning("could not upload to %s (%s); trying again at the next epoch's end", self.mirror.store.shown,
                        exc)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._push()

    def on_train_end(self, logs: dict | None = None) -> None:
        try:
            for pause in (*FINAL_TRIES, None):
                try:
                    self.mirror.push()
                    return
                except OSError as exc:
                    if pause is None:
                        raise storage.StoreError(f"the files written for {self.mirror.store.shown} could not be "
                                                 f"uploaded at the end of training ({exc}). Fix: check the store and "
                                                 "train again (the model in memory is intact)", "unreachable",
                                                 self.mirror.store.shown) from exc
                    log.warning("could not upload to %s (%s); trying again in %g s", self.mirror.store.shown, exc,
                                pause)
                    time.sleep(pause)
        finally:
            restore([self.staging])


class StoreSyncEveryBatch(StoreSync):
    """`StoreSync` for a callback that saves every N batches: a look at the staging directory after each batch
    (a few `stat` calls; an upload only when a file changed)."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._push()


__all__ = ["BACKUP_FILES", "StoreSync", "StoreSyncEveryBatch", "path_of", "pull_backup", "reinit_backup", "restore",
           "route", "shown", "to_store"]
