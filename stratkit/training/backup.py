"""Multi-worker-aware, atomic backup and resume at epoch granularity.

Why not `keras.callbacks.BackupAndRestore`: in Keras 3 it is not multi-worker
aware (one shared dir -> a makedirs race, measured: `FileExistsError` on worker
1, then the chief fails on heartbeats) and it writes the weights file in place,
so a kill mid-write leaves a file that breaks the resume.

Layout:
  backup_dir/                      the chief's checkpoints
    epoch-00003.weights.h5         model + optimizer state after epoch 3
    checkpoint.json                {"epoch": 3, "file": "epoch-00003.weights.h5", "sha256": ...,
                                    "epochs": {"2": <sha256>, "3": <sha256>}}
    workers/worker-1/...           each other worker's own copy (same layout)

Writing (`stratkit.files`): each file goes to a fresh private
temporary, is fsynced and renamed into place; checkpoint.json is renamed last,
so it only ever names complete files, with their SHA-256. Temporaries a killed
writer left behind are removed at the next start. A directory or file that
another user owns, or a symlink someone else planted, is refused.

Resuming: the newest epoch whose file is intact (its checksum matches; a file
with no recorded checksum must read whole) is used. The last `keep` (>= 2)
epochs are kept, so a corrupt latest file falls back to the one before, with
one warning line. An unreadable checkpoint.json is rebuilt from the files that
validate; nothing that cannot be read is ever deleted. On several workers, the
workers agree on the newest epoch every one of them has (a MIN all-reduce),
so workers that died a moment apart resume from the same epoch
(`stratkit.strategy.collectives.min_over_workers`, which the trainer passes in).
A worker counts the chief's copy in backup_dir as one it has: a worker new to
the cluster (an elastic launch grew) then resumes the cluster at the newest
epoch instead of pulling it back to 0.

Size: over 400 lines because the four parts above (checkpoint.json, saving,
resuming, the callback) share one file layout and its checks; split the
callback out (it is the only part that needs a model) if it grows further.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import keras

from stratkit import files, status
from stratkit.strategy.keras_compat import save_guards
from stratkit.errors import ConfigError
from stratkit.strategy import keras_compat

log = status.logger(__name__)

METADATA = "checkpoint.json"
_EPOCH_FILE = re.compile(r"^epoch-(\d{5,})\.weights\.h5$")
_WHAT = "backup_dir"


def worker_backup_dir(backup_dir: str, is_chief: bool, rank: int) -> str:
    """The chief writes to backup_dir itself; every other worker to its own subdirectory."""
    return backup_dir if is_chief else os.path.join(backup_dir, "workers", f"worker-{rank}")


def is_epoch_file(name: str) -> bool:
    """True for the name of an epoch's weights file (never a temporary, never a path)."""
    return bool(_EPOCH_FILE.match(name))


def available_epochs(directory: str) -> list[int]:
    """Epochs with a weights file, newest last (temporary files never match)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_EPOCH_FILE.match, names) if m)


def weights_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"epoch-{epoch:05d}.weights.h5")


def warn(message: str) -> None:
    """One warning line ("[stratkit] warning: ..." on stderr by default), the same on every path (Trainer, PS)."""
    log.warning("%s", message)


# --------------------------------------------------------------------------------------------
# checkpoint.json
# --------------------------------------------------------------------------------------------


@dataclass
class Metadata:
    """What checkpoint.json says: `state` is "ok", "missing" or "corrupt" (then `problem` says why)."""

    state: str
    epoch: int = 0
    digests: dict[int, str | None] = field(default_factory=dict)  # epoch -> sha256 (None: not recorded)
    problem: str = ""


def read_metadata(directory: str) -> Metadata:
    path = os.path.join(directory, METADATA)
    try:
        raw = files.read_bytes(path, f"{_WHAT}={directory!r}")
    except FileNotFoundError:
        return Metadata("missing")
    except OSError as exc:
        return Metadata("corrupt", problem=f"cannot be read: {exc.strerror or exc}")
    try:
        value = json.loads(raw.decode("utf-8"))
        epoch = int(value["epoch"])
        digests: dict[int, str | None] = {int(k): str(v) for k, v in dict(value.get("epochs") or {}).items()}
        digests.setdefault(epoch, value.get("sha256"))  # files written before checksums were kept: None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Metadata("corrupt", problem=f"is not valid ({type(exc).__name__}: {str(exc)[:80]})")
    if epoch < 1 or any(e < 1 for e in digests):
        return Metadata("corrupt", problem=f"names epoch {epoch}")
    return Metadata("ok", epoch=epoch, digests={e: d for e, d in digests.items() if e <= epoch})


def latest_epoch(directory: str) -> int:
    """The epoch checkpoint.json names if its file is there (0 when there is none or it is unreadable)."""
    meta = read_metadata(directory)
    return meta.epoch if meta.state == "ok" and meta.epoch in available_epochs(directory) else 0


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def prepare_dir(directory: str) -> list[str]:
    """Check `directory` is this user's (creating it), and remove what a killed writer left there.

    Returns the names of the stale temporaries removed. Call it only for a
    directory this process alone writes: each worker for its own.
    """
    files.check_dir(directory, _WHAT)
    files.check_file(os.path.join(directory, METADATA), f"{_WHAT}={directory!r}")
    return files.clean_stale_temporaries(directory)


def save_epoch(model: Any, directory: str, epoch: int, keep: int = 2) -> str:
    """Write model+optimizer state after `epoch` atomically, record its checksum, then prune old epochs."""
    files.check_dir(directory, _WHAT)
    final = weights_path(directory, epoch)
    with save_guards.own_path():     # this worker's own backup file, not a shared path
        files.write_with(final, lambda tmp: model.save_weights(tmp, overwrite=True))
    on_disk = set(available_epochs(directory))
    meta = read_metadata(directory)
    digests = {e: d for e, d in meta.digests.items() if epoch - keep < e < epoch and e in on_disk and d}
    digests[epoch] = _sha256(final)
    files.write_bytes(os.path.join(directory, METADATA), json.dumps({
        "epoch": epoch, "file": os.path.basename(final), "sha256": digests[epoch],
        "epochs": {str(e): d for e, d in sorted(digests.items())}}).encode())
    # Keep this epoch and the ones just before it; anything else (older, or stale
    # "future" epochs of an abandoned run) goes.
    for old in on_disk:
        if not epoch - keep < old <= epoch:
            files.remove(weights_path(directory, old))
    return final


def remove_backup(directory: str, keep: str | None = None) -> None:
    """Remove a finished run's files: checkpoint.json first, so a kill midway leaves files that still resume."""
    files.remove(os.path.join(directory, METADATA))
    for epoch in available_epochs(directory):
        path = weights_path(directory, epoch)
        if path != keep:
            files.remove(path)


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------


@dataclass
class ResumePoint:
    """Where a directory says to resume: `epoch` 0 means start over; `note` is the warning to print."""

    epoch: int = 0
    path: str | None = None
    checked: bool = False  # its checksum matched (a load failure then means a different model)
    note: str | None = None


def _problem(path: str, digest: str | None, what: str) -> str | None:
    """Why the weights file at `path` cannot be used, or None when it is intact."""
    try:
        files.check_file(path, what)
        if not os.path.isfile(path):
            return "is missing"
        if digest:
            return None if _sha256(path) == digest else "is corrupt (its SHA-256 does not match checkpoint.json)"
        return _unreadable(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"


def _unreadable(path: str) -> str | None:
    """No checksum was recorded: the file must at least read whole as HDF5."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            handle.visititems(lambda _, obj: obj[()] if isinstance(obj, h5py.Dataset) else None)
    except Exception as exc:  # noqa: BLE001 - any failure to read is a corrupt file
        return f"is corrupt ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"
    return None


def find_resume_point(directory: str) -> ResumePoint:
    """The newest intact epoch in `directory` (without touching any model), and what was skipped.

    Raises:
        ConfigError: there are weights files, but none is intact (nothing is deleted).
    """
    what = f"{_WHAT}={directory!r}"
    meta = read_metadata(directory)
    metadata = os.path.join(directory, METADATA)
    if meta.state == "ok":
        candidates = sorted(meta.digests.items(), reverse=True)
    else:  # no usable checkpoint.json: every weights file on disk, checked by reading it whole
        candidates = [(epoch, None) for epoch in reversed(available_epochs(directory))]
    skipped = []
    for epoch, digest in candidates:
        path = weights_path(directory, epoch)
        problem = _problem(path, digest, what)
        if problem is None:
            point = ResumePoint(epoch, path, checked=bool(digest))
            break
        skipped.append(f"{os.path.basename(path)} {problem}")
    else:
        point = ResumePoint()
        if any(os.path.lexists(weights_path(directory, epoch)) for epoch, _ in candidates):
            head = (f"{metadata} {meta.problem}, and " if meta.state == "corrupt" else "")
            raise ConfigError(f"{head}no backup in {directory} can be used: {'; '.join(skipped)}. Nothing was "
                              f"deleted. Fix: move {directory} away (or pass another backup_dir) to start over, or "
                              "put back an intact copy of those files")
    if meta.state == "corrupt":
        found = (f"rebuilt from the weights files: resuming at epoch {point.epoch} "
                 f"({os.path.basename(point.path)})" if point.epoch else "and there is no weights file: "
                 "starting from epoch 0")
        point.note = f"{metadata} {meta.problem}; {found}" + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
    elif skipped and not point.epoch:  # checkpoint.json names files that are all gone: nothing to resume
        point.note = f"{metadata} names {', '.join(skipped)}: starting from epoch 0"
    elif skipped:
        point.note = (f"{weights_path(directory, candidates[0][0])} {skipped[0].split(' ', 1)[1]}; resuming from "
                      f"epoch {point.epoch} ({os.path.basename(point.path)}) instead"
                      + (f" (also skipped: {'; '.join(skipped[1:])})" if len(skipped) > 1 else ""))
    return point


def load(model: Any, point: ResumePoint) -> None:
    """Load the resume point's file into `model`."""
    try:
        model.load_weights(point.path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file and the fix
        why = ("the file is intact (its checksum matches), so the model differs from the one that wrote it"
               if point.checked else "the file may be damaged, or the model differs from the one that wrote it")
        raise ConfigError(f"cannot resume from {point.path}: {type(exc).__name__}: {exc}. {why}. Fix: build the "
                          f"same model as the run that wrote {os.path.dirname(point.path)}, or move that directory "
                          "away to start over") from exc


def past_end(epoch: int, epochs: int | None, directory: str, say: bool = True) -> bool:
    """True (and one warning) when the backup is past the requested epochs: nothing to train, keep it."""
    if epochs is None or epoch <= int(epochs):
        return False
    if say:
            warn(f"the backup in {directory} is at epoch {epoch}, past epochs={epochs}: no epoch was trained and the "
             f"backup is kept (the model holds epoch {epoch}'s weights). Fix: pass epochs > {epoch} to continue "
             f"training, or move {directory} away to start over")
    return True


def readable_epoch(directory: str) -> int:
    """The newest intact epoch in `directory`, 0 when there is none or it cannot be read (nothing is raised)."""
    try:
        return find_resume_point(directory).epoch
    except (ConfigError, OSError):
        return 0


def _find_copy(epoch: int, directories: list[str]) -> ResumePoint | None:
    """An intact copy of `epoch` in the first of `directories` that has one."""
    for directory in directories:
        meta = read_metadata(directory)
        path = weights_path(directory, epoch)
        digest = meta.digests.get(epoch) if meta.state == "ok" else None
        if os.path.isfile(path) and _problem(path, digest, f"{_WHAT}={directory!r}") is None:
            return ResumePoint(epoch, path, checked=bool(digest))
    return None


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class Backup(keras.callbacks.Callback):
    """Back up after every epoch and resume at the epoch reached.

    Args:
        backup_dir: the user's backup directory (the chief's checkpoints).
        is_chief: this task saves to backup_dir itself; others to their own subdir.
        rank: this worker's rank (names its subdirectory).
        agree_on_epoch: callable(int) -> int returning the MIN over all workers
            (a collective); identity on one worker.
        keep: epochs kept on disk (at least 2, so a corrupt latest file has a fallback).
        resume_note: a warning the chief gives when it resumes (what a resume does not continue).
    """

    def __init__(self, backup_dir: str, *, is_chief: bool = True, rank: int = 0,
                 agree_on_epoch: Any = None, keep: int = 2, resume_note: str | None = None) -> None:
        super().__init__()
        self.backup_dir = backup_dir
        self.is_chief = is_chief
        self.directory = worker_backup_dir(backup_dir, is_chief, rank)
        self.agree_on_epoch = agree_on_epoch or (lambda epoch: epoch)
        self.keep = max(int(keep), 2)
        self.resume_note = resume_note
        self.resumed_epoch = 0
        self._past_end = False
        self._decided: tuple[int, Any, Any] | None = None

    def decide(self) -> int:
        """The epoch this run resumes at (0: from the start), agreed by every worker; decided once.

        The trainer asks before it builds the input pipeline (each epoch's data order depends on it);
        `on_train_begin` then loads that epoch's weights and optimizer state.
        """
        if self._decided is not None:
            return self._decided[0]
        files.check_dir(self.backup_dir, _WHAT)
        prepare_dir(self.directory)  # every worker cleans only its own directory
        local = find_resume_point(self.directory)
        proposal = local.epoch
        if not self.is_chief:
            # A worker new to this world (an elastic launch grew, or its host was replaced) has no copy of its
            # own; the chief's intact copy in backup_dir will do (every worker holds the same weights), so it
            # does not pull the cluster back to epoch 0.
            proposal = max(proposal, readable_epoch(self.backup_dir))
        epoch = int(self.agree_on_epoch(proposal))
        point = local if epoch == local.epoch else None
        if epoch > 0 and point is None:
            # Another worker has only an older epoch (it died first), or this worker lost its copy (e.g. a
            # new host): every worker holds the same weights, so any intact copy of that epoch will do.
            others = [self.backup_dir]
            workers = os.path.join(self.backup_dir, "workers")
            if os.path.isdir(workers):
                others += sorted(os.path.join(workers, name) for name in os.listdir(workers))
            point = _find_copy(epoch, [self.directory] + [d for d in others if d != self.directory])
            if point is None:
                raise ConfigError(f"backup_dir={self.backup_dir!r}: the cluster resumes at epoch {epoch} but this "
                                  f"worker has no intact checkpoint for it in {self.directory!r}. Fix: keep "
                                  "backup_dir on storage every worker can read, or move backup_dir away to start "
                                  "over")
        self._decided = (epoch, point, local)
        return epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        epoch = self.decide()
        _, point, local = self._decided
        if epoch > 0:
            if local.note and point is local:
                warn(local.note)
            load(self.model, point)
            # Keras' own BackupAndRestore resumes the same way; fit() reads it once.
            keras_compat.set_resume_epoch(self.model, epoch)
            log.info("resumed from %s at epoch %d", point.path, epoch)
            if self.resume_note and self.is_chief:
                warn(self.resume_note)
        elif local.note:
            warn(local.note)
        self.resumed_epoch = epoch
        epochs = (self.params or {}).get("epochs")
        # Every worker decides the same (same epoch, same epochs); only the chief says it.
        self._past_end = past_end(epoch, epochs, self.backup_dir, say=self.is_chief)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        save_epoch(self.model, self.directory, epoch + 1, keep=self.keep)

    def on_train_end(self, logs: dict | None = None) -> None:
        keras_compat.set_resume_epoch(self.model, None)
        self._decided = None  # a later fit with this callback decides again
        if self._past_end:
            return  # nothing was trained: the backup stays (every worker decides the same)
        # Training finished: the backup has served its purpose (Keras semantics). Each
        # worker removes its own copy; only the chief removes the shared directory's files.
        # Two barriers (the same collective that agrees on the resume epoch): cleaning
        # must not start before every worker's last save has landed (measured: a slow
        # worker re-created backup_dir/workers after the chief had removed it), and the
        # chief removes the shared directory only after the workers removed their copies.
        self.agree_on_epoch(0)
        if not self.is_chief:
            remove_backup(self.directory)
            shutil.rmtree(self.directory, ignore_errors=True)
        self.agree_on_epoch(0)
        if not self.is_chief:
            return
        remove_backup(self.backup_dir)
        shutil.rmtree(os.path.join(self.backup_dir, "workers"), ignore_errors=True)
        try:
            os.rmdir(self.backup_dir)  # only if nothing of the user's is left in it
        except OSError:
            pass
