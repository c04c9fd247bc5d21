"""What each training process runs for `KerasEstimator.fit`: `train_on_executor`, shipped by `SparkRunner`.

The estimator stages the DataFrame's feature, label (and sample weight)
columns as one Parquet copy (`DataFrameInput`, each column in its own type),
so each worker gets its `ParquetShard` of whole rows; a DataFrame that is a
plain scan of a Parquet table arrives instead as a `stratkit.data.TableInput`
read in place (`stratkit.spark.in_place`), which `Trainer.fit` reads itself
(the estimator's seed and shuffle set its order). In the worker:
  1. `stratkit.Trainer()` first (MultiWorkerMirrored over the Spark tasks),
     then `keras.utils.set_random_seed(seed)` when a seed is set, then the
     user's build function inside the strategy's scope;
  2. the columns are mapped to the model's inputs by the one rule of
     `stratkit.data.feeds` (`ParquetShard.plan`: a bad width, a string for a
     number input, or a cast that would change a value by the staged min/max
     is a `ConfigError` naming the column, which the driver re-raises as
     such), labels to its outputs, each column converted to its input's type;
  3. `Trainer.fit` on the shard's `dataset_fn` (each row once per epoch across
     the workers, the global batch kept), with validation, backups,
     callbacks, and the tracking context's callbacks (`tracking_callbacks`);
  4. `Trainer.save` on every worker (the replica check: workers whose copies
     differ save nothing), and the chief returns the `.keras` bytes, the
     signature as fed (a subclassed model's input dtypes are the ones it
     trained on) and the history to the driver.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stratkit.data import TableInput
from stratkit.data.signature import describe
from stratkit.errors import ConfigError
from stratkit.spark.data import DEFAULT_SEED
from stratkit.spark.ml.signature import PARAMS


@dataclass(frozen=True)
class TrainJob:
    """What the estimator's params say about one training (pickled to every training process)."""

    build_fn: Callable[..., Any]
    build_params: dict[str, Any]
    feature_cols: tuple[str, ...]
    label_cols: tuple[str, ...]
    weight_col: str | None
    epochs: int
    batch_size: int
    steps_per_epoch: int | None = None
    shuffle: bool = True
    seed: int | None = None
    verbose: int = 2
    callbacks: tuple[Any, ...] = ()
    backup_dir: str | None = None
    backup_every: int | str | None = None
    #: The driver's tracking context (e.g. an MLflow run), handed to every worker: `tracking_callbacks` asks it for
    #: the Keras callbacks that log. None: no tracking.
    tracking: Any = field(default=None, compare=False)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every staged column: features, labels, the weight."""
        return self.feature_cols + self.label_cols + ((self.weight_col,) if self.weight_col else ())


def tracking_callbacks(job: TrainJob, trainer: Any) -> list[Any]:
    """The callbacks the driver's tracking context wants in `fit` (on every worker; it decides who logs)."""
    if job.tracking is None:
        return []
    return list(job.tracking.callbacks(trainer))


def train_on_executor(job: TrainJob, data: Any, validation: Any = None) -> dict[str, Any] | None:
    """Train on this worker's shard; the chief returns `{"model": .keras bytes, "signature", "history", ...}`."""
    import stratkit

    trainer = stratkit.Trainer()  # first: the multi-worker strategy must exist before any other TensorFlow op
    import keras

    if job.seed is not None:
        keras.utils.set_random_seed(job.seed)
    model = trainer.build(lambda: job.build_fn(**job.build_params))
    seed = DEFAULT_SEED if job.seed is None else job.seed
    if isinstance(data, TableInput):   # a Parquet scan read in place (stratkit.spark.in_place): Trainer.fit reads it
        data = TableInput(data.table, data.features, data.label, data.sample_weight, seed=seed, shuffle=job.shuffle,
                          lanes=data.lanes, shuffle_window=data.shuffle_window)
        plan = data.feed(model).plan   # before step 1: widths, kinds, lossy casts by the footers' min/max
        fit_steps, steps = job.steps_per_epoch, job.steps_per_epoch or data.steps_per_epoch(job.batch_size)
        train, val, val_steps, batch = data, validation, None, job.batch_size
    else:
        plan = data.plan(model, names=PARAMS)  # before step 1: widths, kinds, lossy casts by the staged min/max
        steps = job.steps_per_epoch or data.steps_per_epoch(job.batch_size, trainer.num_replicas)
        train, batch = data.dataset_fn(job.batch_size, shuffle=job.shuffle, seed=seed, model=plan), None
        fit_steps = steps
        val, val_steps = None, None
        if validation is not None:
            val_batch = _validation_batch(validation, job.batch_size, trainer.num_replicas)
            val_steps = validation.steps_per_epoch(val_batch, trainer.num_replicas)
            val = validation.dataset_fn(val_batch, shuffle=False, model=validation.plan(model, names=PARAMS))
    history = trainer.fit(model, train, epochs=job.epochs, steps_per_epoch=fit_steps, validation_data=val,
                          validation_steps=val_steps, backup_dir=job.backup_dir, backup_every=job.backup_every,
                          global_batch_size=batch,
                          # the other workers as Trainer has them: quiet unless STRATKIT_VERBOSE_WORKERS=1
                          verbose=job.verbose if trainer.is_chief else None,
                          callbacks=[*job.callbacks, *tracking_callbacks(job, trainer)])
    signature = describe(model, fed=plan.signature) or plan.signature
    directory = tempfile.mkdtemp(prefix="stratkit-fit-")
    try:
        path = trainer.save(model, os.path.join(directory, "model.keras"))  # every worker: the replica check
        if not trainer.is_chief or path is None:
            return None
        with open(path, "rb") as handle:
            model_bytes = handle.read()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"model": model_bytes, "signature": signature.to_json(),
            "history": {k: [float(v) for v in values] for k, values in history.history.items()},
            "workers": trainer.spec.num_workers, "replicas": trainer.num_replicas, "steps_per_epoch": steps,
            "keras_version": keras.__version__}


def _validation_batch(shard: Any, batch: int, replicas: int) -> int:
    """The training batch, or smaller when the validation rows are too few for one step of it."""
    local = max(1, replicas // shard.count)
    per_replica = min(batch // replicas, min(shard.shard_sizes()) // local)
    if per_replica < 1:
        raise ConfigError(f"the validation rows are too few for one step on {replicas} replica(s) (the smallest "
                          f"worker's share has {min(shard.shard_sizes())} row(s)). Fix: hold out more rows for "
                          "validation, or train without validation")
    return per_replica * replicas
