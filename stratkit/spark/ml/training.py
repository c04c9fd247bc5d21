"""What each training process runs for `KerasEstimator.fit`: `train_on_executor`, shipped by `SparkRunner`.

The estimator stages the DataFrame's feature, label (and sample weight)
columns as one Parquet copy (`DataFrameInput`, every column a float32
matrix, side by side), so each worker gets its `ParquetShard` of whole rows.
In the worker:
  1. `stratkit.Trainer()` first (MultiWorkerMirrored over the Spark tasks),
     then `keras.utils.set_random_seed(seed)` when a seed is set, then the
     user's build function inside the strategy's scope;
  2. the columns are mapped to the model's inputs by the one rule of
     `signature.plan_inputs` (a bad width is a `ConfigError` naming the
     column, which the driver re-raises as such), labels to its outputs;
  3. `Trainer.fit` on the shard's `dataset_fn` (each row once per epoch across
     the workers, the global batch kept), with validation, backups,
     callbacks, and the tracking context's callbacks (`tracking_callbacks`);
  4. `Trainer.save` on every worker (the replica check: workers whose copies
     differ save nothing), and the chief returns the `.keras` bytes, the
     signature and the history to the driver.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratkit.errors import ConfigError
from stratkit.spark.data import DEFAULT_SEED
from stratkit.spark.ml.signature import Feed, ModelSignature, describe, plan_inputs


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
        """Every staged column, in the order they sit side by side in the staged matrix."""
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
    signature = describe(model)
    widths = data.column_widths()
    feeds = plan_inputs(signature, [(name, widths[name]) for name in job.feature_cols])
    if len(job.label_cols) != len(signature.outputs):
        raise ConfigError(f"labelCols={list(job.label_cols)} names {len(job.label_cols)} column(s) but the model has "
                          f"{len(signature.outputs)} output(s) ({', '.join(p.name for p in signature.outputs)}). Fix: "
                          "one label column per output, in the model's output order")
    split = _splitter(job, signature, feeds, [widths[name] for name in job.columns])
    seed = DEFAULT_SEED if job.seed is None else job.seed
    steps = job.steps_per_epoch or data.steps_per_epoch(job.batch_size, trainer.num_replicas)
    train = _mapped(data.dataset_fn(job.batch_size, shuffle=job.shuffle, seed=seed), split)
    val, val_steps = None, None
    if validation is not None:
        val_batch = _validation_batch(validation, job.batch_size, trainer.num_replicas)
        val_steps = validation.steps_per_epoch(val_batch, trainer.num_replicas)
        val = _mapped(validation.dataset_fn(val_batch, shuffle=False), split)
    history = trainer.fit(model, train, epochs=job.epochs, steps_per_epoch=steps, validation_data=val,
                          validation_steps=val_steps, backup_dir=job.backup_dir, backup_every=job.backup_every,
                          # the other workers as Trainer has them: quiet unless STRATKIT_VERBOSE_WORKERS=1
                          verbose=job.verbose if trainer.is_chief else None,
                          callbacks=[*job.callbacks, *tracking_callbacks(job, trainer)])
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


def _mapped(dataset_fn: Callable[[Any], Any], split: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def fn(input_context: Any) -> Any:
        import tensorflow as tf

        return dataset_fn(input_context).map(split, num_parallel_calls=tf.data.AUTOTUNE)

    return fn


def _splitter(job: TrainJob, signature: ModelSignature, feeds: Sequence[Feed],
              widths: Sequence[int]) -> Callable[[Any], Any]:
    """A tf.data map from the staged matrix (every column side by side) to `(inputs, labels[, weights])`."""
    position = {name: i for i, name in enumerate(job.columns)}
    starts = [sum(widths[:i]) for i in range(len(widths))]
    input_shapes = [feed.reshape(-1, sum(widths[position[c]] for c in feed.columns)) for feed in feeds]
    label_shapes = [_label_shape(widths[position[name]], port.shape) for name, port in zip(job.label_cols,
                                                                                             signature.outputs)]

    def columns(x: Any, names: Sequence[str]) -> Any:
        first, last = position[names[0]], position[names[-1]]
        return x[:, starts[first]:starts[last] + widths[last]]

    import tensorflow as tf

    @tf.autograph.experimental.do_not_convert  # no Python control flow to convert
    def split(x):
        inputs = [tf.cast(tf.reshape(columns(x, feed.columns), shape), feed.port.dtype)
                  for feed, shape in zip(feeds, input_shapes)]
        labels = [tf.reshape(columns(x, [name]), shape) for name, shape in zip(job.label_cols, label_shapes)]
        if signature.input_structure == "dict":
            inputs_struct = {feed.port.name: value for feed, value in zip(feeds, inputs)}
        else:
            inputs_struct = inputs if len(inputs) > 1 else inputs[0]
        if signature.output_structure == "dict":
            labels_struct = {port.name: value for port, value in zip(signature.outputs, labels)}
        else:
            labels_struct = tuple(labels) if len(labels) > 1 else labels[0]
        if job.weight_col:
            return inputs_struct, labels_struct, tf.reshape(columns(x, [job.weight_col]), (-1,))
        return inputs_struct, labels_struct

    return split


def _label_shape(width: int, output_shape: Sequence[int | None]) -> tuple[int, ...]:
    """A label's per-batch shape: the output's when it has as many values, else (rows,) for one value (a class
    index for a softmax head), else (rows, width)."""
    known = all(d is not None for d in output_shape)
    if known and width == max(1, _product(output_shape)):
        return (-1, *output_shape)  # type: ignore[return-value]
    return (-1,) if width == 1 else (-1, width)


def _product(shape: Sequence[int | None]) -> int:
    out = 1
    for d in shape:
        out *= int(d or 1)
    return out
