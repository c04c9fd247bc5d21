"""Epoch-level backups: the names `stratkit.training.backup` always had, over `stratkit.training.checkpoint`.

Backups live in `stratkit.training.checkpoint` (step backups, preemption,
callbacks' state; the layout and the rules of the files are there). This
module keeps the epoch view the parameter-server loop and its evaluator use
(`save_epoch`, `latest_epoch`, `weights_path`, ...) and every name it exported
before, so code that imports `stratkit.training.backup` keeps working.
"""

from __future__ import annotations

import os
import re
from typing import Any

from stratkit.training.checkpoint.callback import Backup
from stratkit.training.checkpoint.layout import (METADATA, WEIGHTS, Metadata, Position, file_name, on_disk,
                                                 read_metadata, worker_backup_dir)
from stratkit.training.checkpoint.store import (ResumePoint, find_copy, find_resume_point, load, past_end,
                                               prepare_dir, remove_backup, warn, write_backup)

__all__ = ["METADATA", "Backup", "Metadata", "ResumePoint", "available_epochs", "find_resume_point",
           "is_epoch_file", "latest_epoch", "load", "past_end", "prepare_dir", "read_metadata", "readable_epoch",
           "remove_backup", "save_epoch", "warn", "weights_path", "worker_backup_dir"]

_EPOCH_FILE = re.compile(r"^epoch-(\d{5,})\.weights\.h5$")


def is_epoch_file(name: str) -> bool:
    """True for the name of an epoch's weights file (never a temporary, never a path, never a step backup)."""
    return bool(_EPOCH_FILE.match(name))


def available_epochs(directory: str) -> list[int]:
    """Epochs with a weights file, newest last (temporaries and step backups never match)."""
    return sorted(p.epoch for p, parts in on_disk(directory).items() if p.step == 0 and WEIGHTS in parts)


def weights_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, file_name(Position(epoch), WEIGHTS))


def latest_epoch(directory: str) -> int:
    """The epoch checkpoint.json names if its file is there (0 when there is none or it is unreadable)."""
    meta = read_metadata(directory)
    latest = meta.latest if meta.state == "ok" else None
    return latest.epoch if latest is not None and latest.step == 0 and latest.epoch in available_epochs(
        directory) else 0


def readable_epoch(directory: str) -> int:
    """The newest intact backup's epoch in `directory`, 0 when there is none or it cannot be read."""
    try:
        return find_resume_point(directory).epoch
    except Exception:  # noqa: BLE001 - unreadable means nothing to resume (ConfigError, OSError)
        return 0


def save_epoch(model: Any, directory: str, epoch: int, keep: int = 2) -> str:
    """Write model+optimizer state after `epoch` atomically, record its checksum, then prune old backups."""
    return write_backup(model, directory, Position(epoch), keep=keep)


def _find_copy(epoch: int, directories: list[str]) -> ResumePoint | None:
    """An intact copy of `epoch` in the first of `directories` that has one."""
    return find_copy(Position(epoch), directories)
