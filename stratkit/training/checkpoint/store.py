"""The on-disk store: write a backup atomically, find the newest intact one, load it, prune and remove them.

Why not `keras.callbacks.BackupAndRestore`: in Keras 3 it is not multi-worker
aware (one shared dir -> a makedirs race, measured: `FileExistsError` on worker
1, then the chief fails on heartbeats) and it writes the weights file in place,
so a kill mid-write leaves a file that breaks the resume.

Writing (`write_backup`, the one function every backup goes through, epoch or
step, Trainer or parameter servers): each file goes to a fresh private
temporary, is fsynced and renamed into place (`stratkit.files`);
checkpoint.json is renamed last, so it only ever names complete files, with
their SHA-256. The previous backup stays intact until the new one is complete:
a kill, a second signal or a full disk mid-write leaves checkpoint.json naming
the previous one. The last `keep` (>= 2) backups are kept, so a corrupt newest
one falls back to the one before, with one warning line. Temporaries a killed
writer left behind are removed at the next start. A directory or file that
another user owns, or a symlink someone else planted, is refused.

Resuming (`find_resume_point`): the newest backup whose files are intact
(checksums match; a file with no recorded checksum must read whole) is used.
An unreadable checkpoint.json is rebuilt from the files that validate;
nothing that cannot be read is ever deleted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from stratkit import files, status
from stratkit.errors import ConfigError
from stratkit.storage import is_url
from stratkit.strategy import replica_check
from stratkit.strategy.keras_compat import save_guards
from stratkit.training.checkpoint.layout import (ARRAYS, METADATA, STATE, WEIGHTS, WHAT, Position, file_name,
                                                 on_disk, read_metadata, sha256, write_metadata)

log = status.logger(__name__)

#: errnos of a write that ran out of room (a full disk, a quota, a file-size limit).
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class BackupWriteError(ConfigError):
    """A backup could not be written (e.g. the disk is full); the previous one is intact."""


def warn(message: str) -> None:
    """One warning line ("[stratkit] warning: ..." on stderr by default), the same on every path (Trainer, PS)."""
    log.warning("%s", message)


def prepare_dir(directory: str) -> list[str]:
    """Check `directory` is this user's (creating it), and remove what a killed writer left there.

    Returns the names of the stale temporaries removed. Call it only for a
    directory this process alone writes: each worker for its own.
    """
    files.check_dir(directory, WHAT)
    files.check_file(os.path.join(directory, METADATA), f"{WHAT}={directory!r}")
    return files.clean_stale_temporaries(directory)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_backup(model: Any, directory: str, position: Position, state: dict | None = None,
                 arrays: dict[str, Any] | None = None, keep: int = 2, *, weights: bool = True) -> str:
    """Write the backup at `position`: the weights file, its state and arrays, then checkpoint.json; prune.

    The one function every backup is written through (epoch and step backups
    of `Trainer.fit` and `stratkit.callbacks.Backup`, the parameter-server
    chief's epochs). Returns the weights file's path. The replica check runs
    first (`stratkit.check_replicas`): replicas whose copies differ raise
    `ReplicaDivergenceError` and nothing is written.

    `weights=False` keeps the weights file the backup at `position` already has
    and replaces its state (an epoch backup completed with the callbacks' state
    once every callback ran its `on_epoch_end`).

    Raises:
        BackupWriteError: the disk (or a quota, or a file-size limit) ran out mid-write; the files
            written for this backup are removed and checkpoint.json still names the previous one.
    """
    files.check_dir(directory, WHAT)
    previous = read_metadata(directory)
    written: dict[str, str] = {}
    path = os.path.join(directory, file_name(position, WEIGHTS))
    kept_weights = previous.backups.get(position, {}).get(file_name(position, WEIGHTS)) if not weights else None
    if not weights and not kept_weights:
        return path  # the backup was superseded (or never completed): nothing to add its state to
    if weights:
        # every worker writes this backup at this position: the same copies everywhere, or no backup
        replica_check.check(model, when=f"before the backup at {position}")
    try:
        if weights:
            with save_guards.own_path():     # this worker's own backup file, not a shared path
                files.write_with(path, lambda tmp: model.save_weights(tmp, overwrite=True))
            written[file_name(position, WEIGHTS)] = sha256(path)
        if arrays:
            import numpy as np

            target = os.path.join(directory, file_name(position, ARRAYS))
            files.write_with(target, lambda tmp: np.savez(tmp, **arrays))
            written[file_name(position, ARRAYS)] = sha256(target)
        if state is not None:
            data = json.dumps(state, indent=1).encode()
            files.write_bytes(os.path.join(directory, file_name(position, STATE)), data)
            written[file_name(position, STATE)] = hashlib.sha256(data).hexdigest()
        kept = _kept(directory, previous.backups if previous.state == "ok" else {}, position, keep)
        kept[position] = written if weights else {file_name(position, WEIGHTS): kept_weights, **written}
        write_metadata(directory, kept)
    except Exception as exc:
        for name in written:  # named by no checkpoint.json: the previous backup is the one that stands
            if name not in previous.backups.get(position, {}):
                files.remove(os.path.join(directory, name))
        if _no_room(exc):
            last = previous.latest if previous.state == "ok" else None
            stands = f"the previous backup ({last}) is intact and a restart resumes from it" if last else \
                "there is no earlier backup"
            raise BackupWriteError(f"could not write the backup at {position} to {WHAT}={directory!r}: "
                                   f"{_reason(exc)}; {stands}. Fix: free space in {directory!r} (or raise its "
                                   "quota), or pass a backup_dir on a disk with room for two backups") from exc
        raise
    _prune(directory, set(kept), keep_parts={position: set(n.split(".", 1)[1] for n in kept[position])})
    return path


def _kept(directory: str, backups: dict[Position, dict[str, str | None]], position: Position,
          keep: int) -> dict[Position, dict[str, str | None]]:
    """The backups before `position` that stay named (the newest `keep` - 1 whose weights are on disk)."""
    present = on_disk(directory)
    older = sorted(p for p, names in backups.items() if p < position and WEIGHTS in present.get(p, ()) and
                   all(v for v in names.values()))
    return {p: backups[p] for p in older[max(len(older) - (max(int(keep), 2) - 1), 0):]}


def _prune(directory: str, kept: set[Position], keep_parts: dict[Position, set[str]]) -> None:
    """Remove every backup file not kept: older ones, "future" ones of an abandoned run, and parts no backup names."""
    for position, parts in on_disk(directory).items():
        for part in parts:
            if position not in kept or (position in keep_parts and part not in keep_parts[position]):
                files.remove(os.path.join(directory, file_name(position, part)))


def _no_room(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True  # h5py reports the errno inside its own message
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _reason(exc: BaseException) -> str:
    """`No space left on device` (not h5py's whole message, which carries it)."""
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        text = os.strerror(code)
        if text in str(exc) or (isinstance(exc, OSError) and exc.errno == code):
            return text
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"


def past_end(epoch: int, epochs: int | None, directory: str, say: bool = True) -> bool:
    """True (and one warning) when the backup is past the requested epochs: nothing to train, keep it."""
    if epochs is None or epoch <= int(epochs):
        return False
    if say:
        warn(f"the backup in {directory} is at epoch {epoch}, past epochs={epochs}: no epoch was trained and the "
             f"backup is kept (the model holds epoch {epoch}'s weights). Fix: pass epochs > {epoch} to continue "
             f"training, or move {directory} away to start over")
    return True


def remove_backup(directory: str, keep: str | None = None) -> None:
    """Remove a finished run's files: checkpoint.json first, so a kill midway leaves files that still resume."""
    files.remove(os.path.join(directory, METADATA))
    for position, parts in on_disk(directory).items():
        for part in parts:
            path = os.path.join(directory, file_name(position, part))
            if path != keep:
                files.remove(path)


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------


@dataclass
class ResumePoint:
    """Where a directory says to resume: position (0, 0) means start over; `note` is the warning to print.

    `path` is the weights file; `files` every file of the backup (name -> path); `checked`: its
    checksums matched (a load failure then means a different model); `source`: where the backup was
    read from when that is not `path`'s directory (a store's backup prefix, its files downloaded to `path`).
    """

    epoch: int = 0
    path: str | None = None
    checked: bool = False
    note: str | None = None
    step: int = 0
    files: dict[str, str] = field(default_factory=dict)
    source: str | None = None

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.step)

    def state(self) -> dict | None:
        """The backup's state.json (None for an epoch backup written before step backups existed)."""
        path = self.files.get(STATE)
        if path is None:
            return None
        return json.loads(files.read_bytes(path, f"{WHAT}={os.path.dirname(path)!r}", limit=1 << 28))

    def arrays(self) -> dict[str, Any]:
        """The backup's arrays (callbacks' weights), {} when it has none."""
        path = self.files.get(ARRAYS)
        if path is None:
            return {}
        import numpy as np

        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}


def _problem(path: str, digest: str | None, what: str) -> str | None:
    """Why the file at `path` cannot be used, or None when it is intact."""
    try:
        files.check_file(path, what)
        if not os.path.isfile(path):
            return "is missing"
        if digest:
            return None if sha256(path) == digest else "is corrupt (its SHA-256 does not match checkpoint.json)"
        return _unreadable(path) if path.endswith(".h5") else "has no recorded checksum"
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


def _check(directory: str, position: Position, names: dict[str, str | None]) -> tuple[ResumePoint | None, str]:
    """The backup's resume point if every file is intact, else (None, what is wrong)."""
    what = f"{WHAT}={directory!r}"
    paths = {}
    for name, digest in sorted(names.items(), key=lambda item: not item[0].endswith(WEIGHTS)):
        path = os.path.join(directory, name)
        problem = _problem(path, digest, what)
        if problem is not None:
            return None, f"{name} {problem}"
        paths[name.split(".", 1)[1]] = path
    return ResumePoint(position.epoch, paths[WEIGHTS], checked=all(names.values()), step=position.step,
                       files=paths), ""


def find_resume_point(directory: str) -> ResumePoint:
    """The newest intact backup in `directory` (without touching any model), and what was skipped.

    `directory` may be a store URL (``s3://bucket/run``): the newest committed backup whose files verify,
    downloaded into this host's staging area (`remote.read_back`; `.source` names it in the store).

    Raises:
        ConfigError: there are backup files, but none is intact (nothing is deleted).
    """
    if is_url(directory):
        from stratkit.training.checkpoint import remote

        return remote.read_back(directory, os.path.join(remote.staging_root(), remote.run_key(directory), "reader"))
    meta = read_metadata(directory)
    metadata = os.path.join(directory, METADATA)
    present = on_disk(directory)
    if meta.state == "ok":
        candidates = sorted(meta.backups.items(), reverse=True)
    else:  # no usable checkpoint.json: every weights file on disk, checked by reading it whole
        candidates = [(p, {file_name(p, WEIGHTS): None}) for p in sorted(present, reverse=True)
                      if WEIGHTS in present[p]]
    skipped = []
    point = ResumePoint()
    for position, names in candidates:
        found, problem = _check(directory, position, names)
        if found is not None:
            point = found
            break
        skipped.append(problem)
    else:
        if any(WEIGHTS in present.get(p, ()) for p, _ in candidates):
            head = (f"{metadata} {meta.problem}, and " if meta.state == "corrupt" else "")
            raise ConfigError(f"{head}no backup in {directory} can be used: {'; '.join(skipped)}. Nothing was "
                              f"deleted. Fix: move {directory} away (or pass another backup_dir) to start over, or "
                              "put back an intact copy of those files")
    name = os.path.basename(point.path) if point.path else ""
    if meta.state == "corrupt":
        found_text = (f"rebuilt from the weights files: resuming at {point.position} ({name})" if point.epoch or
                      point.step else "and there is no weights file: starting from epoch 0")
        point.note = f"{metadata} {meta.problem}; {found_text}" + (f"; skipped: {'; '.join(skipped)}" if skipped
                                                                    else "")
    elif skipped and point.path is None:  # checkpoint.json names files that are all gone: nothing to resume
        point.note = f"{metadata} names {', '.join(skipped)}: starting from epoch 0"
    elif skipped:
        newest = os.path.join(directory, skipped[0].split(" ", 1)[0])
        point.note = (f"{newest} {skipped[0].split(' ', 1)[1]}; resuming from {point.position} ({name}) instead"
                      + (f" (also skipped: {'; '.join(skipped[1:])})" if len(skipped) > 1 else ""))
    return point


def find_copy(position: Position, directories: list[str]) -> ResumePoint | None:
    """An intact copy of the backup at `position` in the first of `directories` that has one."""
    for directory in directories:
        meta = read_metadata(directory)
        if meta.state == "ok" and position in meta.backups:
            found, _ = _check(directory, position, meta.backups[position])
        elif position.step == 0 and os.path.isfile(os.path.join(directory, file_name(position, WEIGHTS))):
            found, _ = _check(directory, position, {file_name(position, WEIGHTS): None})
        else:
            found = None
        if found is not None:
            return found
    return None


def readable_position(directory: str) -> Position:
    """The newest intact backup's position in `directory`, (0, 0) when there is none or it cannot be read."""
    try:
        return find_resume_point(directory).position
    except (ConfigError, OSError):
        return Position()


def load(model: Any, point: ResumePoint) -> None:
    """Load the resume point's weights file (model + optimizer state) into `model`."""
    try:
        model.load_weights(point.path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file and the fix
        why = ("the file is intact (its checksum matches), so the model differs from the one that wrote it"
               if point.checked else "the file may be damaged, or the model differs from the one that wrote it")
        raise ConfigError(f"cannot resume from {point.path}: {type(exc).__name__}: {exc}. {why}. Fix: build the "
                          f"same model as the run that wrote {os.path.dirname(point.path)}, or move that directory "
                          "away to start over (nothing in it was changed)") from exc


def copy_backup(source: str, target: str) -> ResumePoint:
    """Copy the newest intact backup of `source` (its files and a checkpoint.json naming only it) into `target`.

    Returns its resume point in `source` (position (0, 0): nothing to copy). For
    engines that carry a backup elsewhere (Ray Train's checkpoints). `source` may be a store URL: its
    newest committed backup whose files verify is downloaded into `target` (the chief's files).

    Raises:
        ConfigError: `target` is a store URL (a store takes backups only through `Trainer.fit`'s commit).
    """
    if is_url(target):
        raise ConfigError(f"copy_backup: target={target!r} is a store URL; a store takes backups only through a "
                          "run's own commit. Fix: copy into a local directory, or pass the URL as backup_dir to "
                          "Trainer.fit, which resumes from the store's newest committed backup")
    if is_url(source):
        from stratkit.training.checkpoint import remote

        return remote.read_back(source, files.check_dir(target, WHAT))
    point = find_resume_point(source)
    if point.path is None:
        return point
    files.check_dir(target, WHAT)
    names = {}
    for part, path in point.files.items():
        name = os.path.basename(path)
        files.write_with(os.path.join(target, name), lambda tmp, src=path: _copy_file(src, tmp))
        names[name] = sha256(os.path.join(target, name))
    write_metadata(target, {point.position: names})
    return point


def _copy_file(source: str, target: str) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        for block in iter(lambda: reader.read(1 << 20), b""):
            writer.write(block)
