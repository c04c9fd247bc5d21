"""The parameter-server chief's epoch checkpoints in `backup_dir`, and its end-of-training marker.

Files in `backup_dir` (written by the chief, read by the evaluator; every
write through `stratkit.files`, the rules of `stratkit.training.backup`):
  epoch-00003.weights.h5   model + optimizer after epoch 3 (the last 2 kept)
  checkpoint.json          names the newest complete epoch file
  training-done.json       written when training ends and the cluster has an
                           evaluator: {"epoch": E, "file": ...}; the named
                           weights file is kept for the evaluator's last pass
  eval/                    the evaluator's TensorBoard summaries
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from stratkit import files, status
from stratkit.training import backup as backup_lib

log = status.logger(__name__)

DONE_FILE = "training-done.json"


class ChiefCheckpoints:
    """The chief's epoch checkpoints: atomic save, resume after a restart, the evaluator's last file.

    The same files and rules as the `Trainer` backup (`stratkit.training.backup`):
    someone else's directory or symlink is refused, a dead writer's temporaries
    are removed, a corrupt latest epoch falls back to the one before, an
    unreadable checkpoint.json is rebuilt from the files, nothing unreadable is
    deleted. A finished run removes its checkpoints (a rerun starts over, as
    Keras' BackupAndRestore); with an evaluator in the cluster it keeps the last
    epoch's file and names it in `training-done.json`, the evaluator's signal. A
    backup already past `epochs` trains nothing and is kept.
    """

    def __init__(self, backup_dir: str | None, has_evaluator: bool, epochs: int | None = None) -> None:
        self.directory = backup_dir
        self.has_evaluator = has_evaluator
        self.epochs = epochs
        self.past_end = False

    def resume(self, model: Any) -> int:
        """Load the newest good epoch into `model` and return it (0: start from scratch)."""
        if self.directory is None:
            return 0
        backup_lib.prepare_dir(self.directory)
        done = read_done_marker(self.directory)
        if done is not None:
            # A previous run's end: not this run's (the evaluator ignores markers older than itself). The
            # file it kept for the evaluator goes too, unless it is also this run's resume point.
            files.remove(os.path.join(self.directory, DONE_FILE))
            kept = str(done.get("file", ""))
            if backup_lib.is_epoch_file(kept) and done.get("epoch") != backup_lib.latest_epoch(self.directory):
                files.remove(os.path.join(self.directory, kept))
        point = backup_lib.find_resume_point(self.directory)
        if point.note:
            backup_lib.warn(point.note)
        if point.epoch == 0:
            return 0
        backup_lib.load(model, point)
        log.info("resumed from %s at epoch %d", point.path, point.epoch)
        self.past_end = backup_lib.past_end(point.epoch, self.epochs, self.directory)
        return point.epoch

    def save(self, model: Any, epoch: int) -> None:
        if self.directory is not None:
            backup_lib.save_epoch(model, self.directory, epoch)

    def finish(self, epoch: int) -> None:
        """Remove the run's checkpoints, keeping (and naming) the last one for an evaluator."""
        if self.directory is None:
            return
        keep = backup_lib.weights_path(self.directory, epoch) if self.has_evaluator and epoch > 0 else None
        if keep is not None and os.path.exists(keep):
            files.write_bytes(os.path.join(self.directory, DONE_FILE),
                              json.dumps({"epoch": epoch, "file": os.path.basename(keep), "time": time.time()})
                              .encode())
        if self.past_end:
            return  # nothing was trained: the backup stays
        backup_lib.remove_backup(self.directory, keep=keep)
        try:
            os.rmdir(self.directory)  # only if nothing of the user's (or the evaluator's) is left in it
        except OSError:
            pass


def read_done_marker(directory: str) -> dict | None:
    """The chief's end-of-training marker in `directory`, or None (not through a symlink, only ours)."""
    try:
        marker = json.loads(files.read_bytes(os.path.join(directory, DONE_FILE), f"backup_dir={directory!r}"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "epoch" in marker and "file" in marker else None
