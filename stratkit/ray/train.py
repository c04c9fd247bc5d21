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
* with `backup_every`, each step backup and the preemption backup is reported
  the same way when it is written (`Backup`'s `on_backup_written`, on every
  worker at the same step; the epochs' reports then carry metrics only);
* a preemption notice (SIGTERM, or STRATKIT_PREEMPTION_SIGNAL, to a worker's
  process): Ray Train runs the loop in a thread of its worker actor, and only
  the main thread may catch signals, so the handlers are installed through an
  actor call, which runs in the actor's main thread. Every worker stops at the
  same step, the backup is reported, the report is waited for until Ray's
  controller has taken it, and the worker exits 75; Ray Train's restart
  (`FailureConfig(max_failures)`: Ray counts it as a worker failure) resumes
  at that step;
* at the start of an attempt the callback copies Ray's latest checkpoint into
  a fresh private `backup_dir` on each worker, and `Trainer.fit` resumes from it
  at its epoch and step, with the data order of an uninterrupted run.
* `RayReportCallback(backup_dir="s3://...")` (a store URL): `Trainer.fit` resumes
  from the store's newest committed backup (`stratkit.training.checkpoint.remote`),
  so Ray's checkpoint is not copied in; the reports still carry each backup, from
  the chief's local staging directory.

Imports Keras (it is a Keras callback) and Ray, checked by `stratkit.ray.versions`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

import keras

from stratkit import status
from stratkit.ray.versions import import_ray
from stratkit.storage import is_url, redact
from stratkit.strategy.keras_compat import callback_state
from stratkit.training import checkpoint as backups
from stratkit.training.checkpoint import preemption

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
        self.resumed = backups.Position()
        self._warned = False
        self._per_step = False
        self._backup: Any = None
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None and is_url(self.backup_dir):
            log.info("rank %d: backup_dir is %s: the run resumes from the store's newest committed backup, not "
                     "from Ray's checkpoint", self.rank, redact(self.backup_dir))
        elif checkpoint is not None:
            with checkpoint.as_directory() as directory:
                self.resumed = _copy_backup(directory, self.backup_dir)
            self.resumed_epoch = self.resumed.epoch
            log.info("rank %d: Ray checkpoint at %s restored into %s", self.rank, self.resumed, self.backup_dir)
        if threading.current_thread() is not threading.main_thread():
            preemption.set_main_thread_caller(_in_actor_main_thread)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        backup = next((c for c in callback_state.callbacks_of(self) or [] if isinstance(c, backups.Backup)), None)
        self._per_step = backup is not None and backup.every.per_step
        self._backup = backup

    def on_backup_written(self, *, position: backups.Position, global_step: int, reason: str,
                          directory: str) -> None:
        """A step backup or the preemption backup: reported as a Ray checkpoint (every worker is here too)."""
        if reason == "epoch":
            return  # reported with the epoch's metrics
        metrics = {"epoch": position.epoch, "step": position.step, "global_step": global_step}
        self._report(metrics, position)
        if reason == "preemption":
            # Ray Train's controller takes a report when it polls the worker; this process exits 75 right after
            # this. A report waits for the one before it to be taken (Ray's queue holds one): so once this one
            # is back, the checkpoint is Ray's.
            self._train.report(dict(metrics, preempted=1))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        metrics: dict[str, Any] = {"epoch": epoch + 1}
        for key, value in (logs or {}).items():
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError):
                continue
        if self._per_step:  # the checkpoints went with the step backups
            self._train.report(metrics)
            return
        self._report(metrics, backups.Position(epoch + 1, 0))

    def _report(self, metrics: dict[str, Any], position: backups.Position) -> None:
        """Every worker reports; the chief attaches the backup at `position` as a checkpoint."""
        if self.rank != 0:
            self._train.report(metrics)
            return
        # The chief's own backup directory: backup_dir itself, or with a store URL its local staging directory
        # (the backup at `position` is written there now; the store commits it a moment later).
        source = self._backup.directory if self._backup is not None and is_url(self.backup_dir) else self.backup_dir
        with tempfile.TemporaryDirectory(prefix="stratkit-ray-checkpoint-") as staging:
            if _copy_backup(source, staging) != position:
                if not self._warned:
                    self._warned = True
                    log.warning("RayReportCallback found no backup at %s in %s: reporting metrics without "
                                "a checkpoint. Fix: pass backup_dir=callback.backup_dir to Trainer.fit",
                                position, self.backup_dir)
                self._train.report(metrics)
                return
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(staging))

    def on_train_end(self, logs: dict | None = None) -> None:
        # Ray keeps the reported checkpoints; the working copy is ours to remove.
        if self._owned:
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _copy_backup(source: str, target: str) -> backups.Position:
    """Copy the newest intact backup of `source` (its files and a checkpoint.json naming only it); its position.

    (`stratkit.training.checkpoint.copy_backup`: a step backup's state and arrays files travel with its weights.)
    """
    os.makedirs(target, exist_ok=True)
    return backups.copy_backup(source, target).position


#: Functions waiting to run in the actor's main thread, by key (the actor call carries the key: the function
#: itself must run in this process, not as a pickled copy).
_main_thread_calls: dict[int, Any] = {}


def _in_actor_main_thread(function: Any) -> None:
    """Run `function` in this Ray actor's main thread (where its calls run: a Ray Train worker is a
    one-at-a-time actor) and return once it ran; used to install signal handlers from the training thread."""
    import ray

    key = id(function)
    _main_thread_calls[key] = function
    try:
        ray.get(ray.get_runtime_context().current_actor.__ray_call__.remote(_call_registered, key), timeout=60)
    except Exception as exc:  # noqa: BLE001 - not in an actor, or it did not answer: train on without them
        log.warning("could not reach this Ray worker's main thread (%s: %s): preemption notices are not caught "
                    "here, so a preempted run resumes from its last reported checkpoint", type(exc).__name__, exc)
    finally:
        _main_thread_calls.pop(key, None)


def _call_registered(actor: Any, key: int) -> None:
    _main_thread_calls[key]()
