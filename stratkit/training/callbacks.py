"""Callbacks stratkit adds to `fit`: throughput, learning-rate scaling with warmup,
and the chief-only rules for side effects (progress bar, TensorBoard, checkpoints).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
import weakref
from typing import Any, Iterable

import keras

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.strategy import keras_compat
from stratkit.training import scratch

log = status.logger(__name__)


class Throughput(keras.callbacks.Callback):
    """Report examples/sec per epoch (a status line on the chief; added to the epoch logs).

    It has no per-batch hook on purpose: any `on_train_batch_end` makes Keras
    synchronise with the device after every step (measured: ~20% fewer
    steps/sec on a small MLP). It times the epoch up to the start of validation
    and counts the steps that really ran as the change of
    `optimizer.iterations` over the epoch (read twice per epoch), not the
    steps asked for: an epoch stopped early (`model.stop_training`) or cut
    short by data that ran out reports what it did. Without an optimizer it
    falls back to Keras' `params["steps"]`.

    Args:
        global_batch_size: examples per step across the cluster.
        verbose: print a line per epoch (stratkit turns this off on non-chief workers).
    """

    def __init__(self, global_batch_size: int, verbose: bool = True) -> None:
        super().__init__()
        self.global_batch_size = int(global_batch_size)
        self.verbose = verbose
        self.history: list[float] = []
        self._start = 0.0
        self._train_end: float | None = None
        self._iterations_at_start: int | None = None

    def _iterations(self) -> int | None:
        iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
        return None if iterations is None else int(keras.ops.convert_to_numpy(iterations))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._iterations_at_start = self._iterations()
        self._start = time.perf_counter()
        self._train_end = None

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self._train_end is None:  # validation inside fit: training steps are over
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        seconds = max((self._train_end or time.perf_counter()) - self._start, 1e-9)
        end = self._iterations()
        if end is not None and self._iterations_at_start is not None:
            steps = end - self._iterations_at_start
        else:
            steps = (self.params or {}).get("steps")
        if not steps:
            return  # unknown epoch length, or nothing ran: nothing honest to report
        rate = steps * self.global_batch_size / seconds
        self.history.append(rate)
        if logs is not None:
            logs["examples_per_sec"] = rate
        if self.verbose:
            log.info("epoch %d: %s examples/sec (%d steps x global batch %d, %.2fs)", epoch + 1, f"{rate:,.0f}",
                     steps, self.global_batch_size, seconds)


def _learning_rate_variable(model: Any) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ConfigError("scale_learning_rate=True needs a compiled model. Fix: call model.compile(optimizer=...) "
                          "in the function passed to trainer.build")
    configured = keras_compat.configured_learning_rate(optimizer)
    if isinstance(configured, keras.optimizers.schedules.LearningRateSchedule) or callable(configured):
        raise ConfigError(f"scale_learning_rate=True needs a constant learning rate, but the optimizer uses "
                          f"{type(configured).__name__}. Fix: scale the schedule's initial rate by "
                          "trainer.num_replicas yourself and pass scale_learning_rate=False")
    return optimizer.learning_rate


class LinearScalingWarmup(keras.callbacks.Callback):
    """The linear scaling rule with gradual warmup (Goyal et al. 2017).

    The learning rate goes linearly from the compiled rate `lr` to `lr x scale`
    over the first `warmup_epochs` epochs (per step), then stays at `lr x scale`.

    Args:
        scale: the factor, normally the number of replicas.
        warmup_epochs: epochs of warmup (0: scale at once).
        steps_per_epoch: steps in one epoch (needed for a per-step ramp).
    """

    def __init__(self, scale: float, warmup_epochs: int = 0, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if warmup_epochs and not steps_per_epoch:
            raise ConfigError("warmup_epochs needs the number of steps per epoch. Fix: pass steps_per_epoch=N "
                              "to fit when the data's length is unknown")
        self.scale = float(scale)
        self.warmup_epochs = int(warmup_epochs)
        self.steps_per_epoch = steps_per_epoch
        self.base_lr: float | None = None
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        variable = _learning_rate_variable(self.model)
        if self.base_lr is None:
            self.base_lr = float(keras.ops.convert_to_numpy(variable))
        self._set(self._rate(0, 0))

    def _rate(self, epoch: int, batch: int) -> float:
        assert self.base_lr is not None
        if self.warmup_epochs <= 0:
            return self.base_lr * self.scale
        progress = min((epoch * self.steps_per_epoch + batch) / (self.warmup_epochs * self.steps_per_epoch), 1.0)
        return self.base_lr * (1.0 + (self.scale - 1.0) * progress)

    def _set(self, value: float) -> None:
        self.model.optimizer.learning_rate.assign(value)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.warmup_epochs > 0 and self._epoch <= self.warmup_epochs:
            self._set(self._rate(self._epoch, batch))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


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
    if os.path.isdir(source):
        shutil.copytree(source, private_dir)
    private = copy.copy(callback)
    # The public constructor re-derives every path from backup_dir; the rest of the copy is kept.
    keras.callbacks.BackupAndRestore.__init__(private, private_dir, save_freq=callback.save_freq,
                                              double_checkpoint=callback.double_checkpoint,
                                              delete_checkpoint=callback.delete_checkpoint)
    _PRIVATE_COPIES.add(private)
    return private


def _refuse_unroutable(callback: Any) -> None:
    orbax = getattr(keras.callbacks, "OrbaxCheckpoint", None)
    if orbax is not None and isinstance(callback, orbax):
        raise ConfigError(f"callbacks=[{type(callback).__name__}(...)] would write the same checkpoint directory "
                          "from every worker, and stratkit cannot give the other workers a private one. Fix: use "
                          "keras.callbacks.ModelCheckpoint or keras.callbacks.BackupAndRestore (stratkit routes "
                          "them), or stratkit.Trainer(...).fit(backup_dir=...)")


def _gather_ints(strategy: Any, value: int) -> list[int]:
    """Every worker's `value` (a collective: every worker must call it)."""
    import tensorflow as tf

    per_replica = strategy.run(lambda: tf.constant([value], tf.int64))
    return [int(v) for v in strategy.gather(per_replica, axis=0).numpy()]


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
        epochs = _gather_ints(self.model.distribute_strategy, keras_compat.resume_epoch(self.model))
        if min(epochs) != max(epochs):
            raise ConfigError(f"BackupAndRestore(backup_dir={self.backup_dir!r}): the workers would resume at "
                              f"different epochs {epochs} (one per worker, chief first): some worker cannot read "
                              "the chief's backup. Fix: keep backup_dir on storage every worker can read, and use "
                              "a new backup_dir for each model.fit call (or delete it to start over)")


def route_side_effects(callbacks: Iterable[Any], is_chief: bool, *,
                       multi_worker: bool = False) -> tuple[list[Any], list[str]]:
    """The callbacks to train with: on non-chief workers, file writers write to private temp dirs.

    Every worker still runs every callback (reading synchronised variables may
    need all workers), but only the chief's files land where the user asked.
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
    if multi_worker:
        agreed: list[Any] = []
        for callback in callbacks:
            agreed.append(callback)
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                agreed.append(AgreeOnResume(os.fspath(callback.backup_dir)))
        callbacks = agreed
    if is_chief:
        return callbacks, []
    routed: list[Any] = []
    temps: list[str] = []
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
    """Remove the private directories `route_side_effects` made (they go anyway when the worker ends)."""
    scratch.remove(paths)


def default_verbose(is_chief: bool) -> Any:
    """Progress bar on the chief ("auto": a bar on a terminal, a line per epoch in logs); workers quiet.

    `STRATKIT_VERBOSE_WORKERS=1` shows every worker's. Used by `Trainer.fit` and,
    for a plain `model.fit` under `make_strategy()`, by the guard in
    `stratkit.strategy.keras_compat` (an explicit `verbose=` always wins).
    """
    if not is_chief and os.environ.get("STRATKIT_VERBOSE_WORKERS", "") not in ("1", "true", "yes"):
        return 0
    return 1 if sys.stdout.isatty() else 2


class PhaseMarks(keras.callbacks.Callback):
    """Mark the first step and the end of training on the launcher's timeline (`stratkit.timeline`).

    Only `on_train_batch_begin` for the first two batches (the second one's
    begin is the first step done: tracing and the first collective are in it);
    no batch-end hook, which would make Keras synchronise after every step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._batches = 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._batches < 2:
            from stratkit import timeline

            timeline.mark("first step begins" if self._batches == 0 else "first step done")
            self._batches += 1

    def on_train_end(self, logs: dict | None = None) -> None:
        from stratkit import timeline

        timeline.mark("training ends")
