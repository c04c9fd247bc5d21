"""Inside Ray Train: report metrics and checkpoints the Ray way, and resume from Ray's checkpoint exactly.

`ray.train.tensorflow.TensorflowTrainer` writes a TF_CONFIG for every worker
("worker" tasks, rank = index), which `stratkit.Trainer` reads like any other,
so a `Trainer` in `train_loop_per_worker` trains as one process. What Ray adds
is its own reporting and fault tolerance: `ray.train.report(metrics,
checkpoint)` and, after a restart (`FailureConfig(max_failures=k)`),
`ray.train.get_checkpoint()`. `RayReportCallback` joins the two:

    report = RayReportCallback()                      # restores Ray's checkpoint, if any
    trainer.fit(model, (x, y), epochs=10, global_batch_size=64,
                backup_dir=report.backup_dir, callbacks=[report])

* every epoch, every worker calls `ray.train.report` (Ray Train V2 needs all of
  them); the chief (rank 0) attaches a checkpoint: the epoch `Trainer.fit`'s
  `backup_dir` just wrote (`stratkit.training.checkpoint`: weights and optimizer
  state, checksummed);
* at the start of an attempt the callback copies Ray's latest checkpoint into
  a fresh private `backup_dir` on each worker, and `Trainer.fit` resumes from it
  with the data order of an uninterrupted run (the backup's own rule).

Imports Keras (it is a Keras callback) and Ray, checked by `stratkit.ray.versions`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import keras

from stratkit import status
from stratkit.ray.versions import import_ray
from stratkit.training import checkpoint as backups

log = status.logger(__name__)


class RayReportCallback(keras.callbacks.Callback):
    """`ray.train.report` per epoch from every worker, with the chief's checkpoint; resume from Ray's.

    Args:
        backup_dir: the directory to pass to `Trainer.fit(backup_dir=...)`; default: a fresh private
            temporary directory per worker, removed at the end of training. Ray's latest checkpoint
            (`ray.train.get_checkpoint()`) is copied into it when the callback is made.

    Attributes:
        backup_dir: pass it to `Trainer.fit(backup_dir=...)`.
        resumed_epoch: the epoch Ray's checkpoint holds (0: none; training starts from scratch).
        rank: this worker's Ray world rank (0 is the chief).
    """

    def __init__(self, backup_dir: str | None = None) -> None:
        super().__init__()
        import_ray("RayReportCallback")
        import ray.train

        self._train = ray.train
        self.rank = ray.train.get_context().get_world_rank()
        self._owned = backup_dir is None
        self.backup_dir = tempfile.mkdtemp(prefix="stratkit-ray-backup-") if backup_dir is None else backup_dir
        self.resumed_epoch = 0
        self._warned = False
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                self.resumed_epoch = _copy_backup(directory, self.backup_dir)
            log.info("rank %d: Ray checkpoint at epoch %d restored into %s", self.rank, self.resumed_epoch,
                     self.backup_dir)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        metrics: dict[str, Any] = {"epoch": epoch + 1}
        for key, value in (logs or {}).items():
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError):
                continue
        if self.rank != 0:
            self._train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="stratkit-ray-checkpoint-") as staging:
            if _copy_backup(self.backup_dir, staging) != epoch + 1:
                if not self._warned:
                    self._warned = True
                    log.warning("RayReportCallback found no backup of epoch %d in %s: reporting metrics without "
                                "a checkpoint. Fix: pass backup_dir=callback.backup_dir to Trainer.fit",
                                epoch + 1, self.backup_dir)
                self._train.report(metrics)
                return
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(staging))

    def on_train_end(self, logs: dict | None = None) -> None:
        # Ray keeps the reported checkpoints; the working copy is ours to remove.
        if self._owned:
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _copy_backup(source: str, target: str) -> int:
    """Copy the newest intact backup of `source` (its files and a checkpoint.json naming only it); its epoch, 0 if none.

    (`stratkit.training.checkpoint.copy_backup`: a step backup's state and arrays files travel with its weights.)
    """
    os.makedirs(target, exist_ok=True)
    return backups.copy_backup(source, target).epoch
