"""Multi-worker-aware, atomic backup and resume at epoch granularity.

Why not `keras.callbacks.BackupAndRestore`: in Keras 3 it is not multi-worker
aware (one shared dir -> a makedirs race, measured: `FileExistsError` on worker
1, then the chief fails on heartbeats) and it writes the weights file in place,
so a kill mid-write leaves a file that breaks the resume.

Layout:
  backup_dir/                      the chief's checkpoints
    epoch-00003.weights.h5         model + optimizer state after epoch 3
    checkpoint.json                {"epoch": 3, "file": "epoch-00003.weights.h5"}
    workers/worker-1/...           each other worker's own copy (same layout)

Each file is written to a temporary name, fsynced and renamed into place;
checkpoint.json is renamed last, so it only ever names a complete file. The
last `keep` epochs are kept so that workers that died a moment apart (one saved
epoch N, another only N-1) can all resume from the same epoch: on resume the
workers agree on the newest epoch every one of them has (a MIN all-reduce).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import keras

log = logging.getLogger(__name__)

METADATA = "checkpoint.json"
_EPOCH_FILE = re.compile(r"^epoch-(\d{5,})\.weights\.h5$")


def worker_backup_dir(backup_dir: str, is_chief: bool, rank: int) -> str:
    """The chief writes to backup_dir itself; every other worker to its own subdirectory."""
    return backup_dir if is_chief else os.path.join(backup_dir, "workers", f"worker-{rank}")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def available_epochs(directory: str) -> list[int]:
    """Epochs with a complete weights file, newest last (temporary files never match)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_EPOCH_FILE.match, names) if m)


def latest_epoch(directory: str) -> int:
    """The epoch checkpoint.json names (0 when there is none or it is unreadable)."""
    try:
        with open(os.path.join(directory, METADATA)) as handle:
            epoch = int(json.load(handle)["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return epoch if epoch in available_epochs(directory) else 0


def weights_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"epoch-{epoch:05d}.weights.h5")


def save_epoch(model: Any, directory: str, epoch: int, keep: int = 2) -> str:
    """Write model+optimizer state after `epoch` atomically, then prune old epochs."""
    os.makedirs(directory, exist_ok=True)
    final = weights_path(directory, epoch)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-epoch-{epoch:05d}.weights.h5")
    model.save_weights(tmp, overwrite=True)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    _atomic_write_text(os.path.join(directory, METADATA),
                       json.dumps({"epoch": epoch, "file": os.path.basename(final)}))
    _fsync_dir(directory)
    # Keep this epoch and the ones just before it; anything else (older, or stale
    # "future" epochs of an abandoned run) goes.
    for old in available_epochs(directory):
        if not epoch - keep < old <= epoch:
            _remove(weights_path(directory, old))
    return final


class Backup(keras.callbacks.Callback):
    """Back up after every epoch and resume at the epoch reached.

    Args:
        backup_dir: the user's backup directory (the chief's checkpoints).
        is_chief: this task saves to backup_dir itself; others to their own subdir.
        rank: this worker's rank (names its subdirectory).
        agree_on_epoch: callable(int) -> int returning the MIN over all workers
            (a collective); identity on one worker.
        keep: epochs kept on disk.
    """

    def __init__(self, backup_dir: str, *, is_chief: bool = True, rank: int = 0,
                 agree_on_epoch: Any = None, keep: int = 2) -> None:
        super().__init__()
        self.backup_dir = backup_dir
        self.is_chief = is_chief
        self.directory = worker_backup_dir(backup_dir, is_chief, rank)
        self.agree_on_epoch = agree_on_epoch or (lambda epoch: epoch)
        self.keep = max(int(keep), 2)
        self.resumed_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        local = latest_epoch(self.directory)
        epoch = int(self.agree_on_epoch(local))
        if epoch > 0 and epoch not in available_epochs(self.directory):
            # This worker lost its copy (e.g. a new host): fall back to the chief's.
            source = self.backup_dir if epoch in available_epochs(self.backup_dir) else None
            if source is None:
                raise RuntimeError(f"backup_dir={self.backup_dir!r}: the cluster resumes at epoch {epoch} but this "
                                   f"worker has no checkpoint for it in {self.directory!r}. Fix: keep backup_dir on "
                                   "storage every worker can read, or delete backup_dir to start over")
            path = weights_path(source, epoch)
        else:
            path = weights_path(self.directory, epoch)
        if epoch > 0:
            self.model.load_weights(path)
            # Keras' own BackupAndRestore resumes through this attribute; fit() reads it once.
            self.model._initial_epoch = epoch
            print(f"[stratkit] resumed from {path} at epoch {epoch}", flush=True)
        self.resumed_epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        save_epoch(self.model, self.directory, epoch + 1, keep=self.keep)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.model._initial_epoch = None
        # Training finished: the backup has served its purpose (Keras semantics). Each
        # worker removes its own copy; only the chief removes the shared directory's files.
        # Two barriers (the same collective that agrees on the resume epoch): cleaning
        # must not start before every worker's last save has landed (measured: a slow
        # worker re-created backup_dir/workers after the chief had removed it), and the
        # chief removes the shared directory only after the workers removed their copies.
        self.agree_on_epoch(0)
        if not self.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.agree_on_epoch(0)
        if not self.is_chief:
            return
        for epoch in available_epochs(self.backup_dir):
            _remove(weights_path(self.backup_dir, epoch))
        _remove(os.path.join(self.backup_dir, METADATA))
        shutil.rmtree(os.path.join(self.backup_dir, "workers"), ignore_errors=True)
        try:
            os.rmdir(self.backup_dir)  # only if nothing of the user's is left in it
        except OSError:
            pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
