"""`Trainer.fit` and `Trainer.evaluate` on a parameter-server cluster: which task does what."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable

import keras

from stratkit.errors import ConfigError
from stratkit.strategy import keras_ps, side_effects, store_callbacks
from stratkit.training import inputs
from stratkit.training.ps import variables
from stratkit.training.ps.coordinator import CoordinatorLoop
from stratkit.training.ps.evaluator import run_sidecar_evaluation
from stratkit.training.ps.metrics import Metrics


def fit_parameter_server(trainer: Any, model: Any, data: Any, *, epochs: int, steps_per_epoch: int | None,
                         validation_data: Any = None, global_batch_size: int | None = None,
                         backup_dir: str | os.PathLike[str] | None = None, callbacks: Iterable[Any] = (),
                         verbose: Any = None, validation_steps: int | None = None) -> keras.callbacks.History:
    """`Trainer.fit` on a parameter-server cluster: the coordinator loop on the chief, the sidecar on the evaluator.

    Args:
        trainer: the `stratkit.Trainer` (its `spec` and `strategy`).
        model: from `trainer.build`: compiled, variables created under the strategy.
        data: `(x, y)` / `(x, y, sample_weight)` numpy arrays, a `tf.data.Dataset`
            (unbatched, or batched with the global batch: each worker then reads
            every N-th batch), or `dataset_fn(input_context)` returning a dataset
            batched with `input_context.get_per_replica_batch_size(global_batch)`.
            Each worker reads its own shard, repeated: `input_context.input_pipeline_id`
            is the worker's index, `num_input_pipelines` the number of workers.
        epochs: total epochs (a resumed run continues to this number).
        steps_per_epoch: required: steps scheduled per epoch (one step = one global
            batch on one worker).
        validation_data: on the chief, evaluated by the chief after each epoch
            (exactly once over the data, or `validation_steps` batches); on the
            evaluator, what it evaluates each checkpoint on.
        global_batch_size: examples per step (None only with a dataset_fn).
        backup_dir: a directory every task can read: the chief checkpoints there
            each epoch and resumes from it after a restart; the evaluator watches it.
        callbacks: Keras callbacks; they get on_train_begin, on_epoch_begin,
            on_epoch_end (with the epoch's logs) and on_train_end. Per-batch hooks are
            not called: asynchronous steps finish out of order.
        verbose: 0 silences the per-epoch line.

    Returns:
        A `keras.callbacks.History` (`.history`: per-epoch loss, metrics and
        val_ metrics, as `model.fit`). It also carries `.steps` (the atomic step
        counter: steps this model has trained, over all fits, like
        `optimizer.iterations`), `.steps_scheduled` (the same, scheduled) and
        `.initial_epoch` (the epoch resumed at).
    """
    keras_ps.check(model)  # an unsupported Keras fails here, not deep in a step
    check_steps_per_epoch(steps_per_epoch)
    spec = trainer.spec
    if spec.task_type == "evaluator":
        return run_sidecar_evaluation(trainer, model, validation_data, backup_dir=backup_dir,
                                      global_batch_size=global_batch_size, validation_steps=validation_steps,
                                      callbacks=callbacks, verbose=verbose)
    if not spec.is_chief:  # pragma: no cover - ps/worker tasks never return from Trainer()
        raise ConfigError(f"trainer.fit on task {spec.task_type}:{spec.task_index} of a parameter-server cluster: "
                          "only the chief trains. Fix: create stratkit.Trainer() before anything else, so ps and "
                          "worker tasks serve instead of reaching fit")
    if "evaluator" in spec.cluster and backup_dir is None:
        raise ConfigError("backup_dir=None, but the cluster has an evaluator task, which evaluates the chief's "
                          "checkpoints in backup_dir. Fix: pass backup_dir=<a directory every task can read> to "
                          "trainer.fit (the same on every task)")
    loop = CoordinatorLoop.for_model(trainer, model)
    # The chief alone runs the callbacks: a store URL as their path is written locally and uploaded.
    temps: list[str] = []
    try:
        routed = [c for callback in callbacks or () for c in store_callbacks.to_store(callback, temps)]
        return loop.fit(data, epochs=epochs, steps_per_epoch=int(steps_per_epoch), validation_data=validation_data,
                        global_batch_size=global_batch_size,
                        backup_dir=None if backup_dir is None else os.fspath(backup_dir), callbacks=routed,
                        verbose=verbose, validation_steps=validation_steps)
    finally:
        side_effects.remove_dirs(temps)


def check_steps_per_epoch(steps_per_epoch: Any) -> None:
    """PS training schedules a fixed number of steps: `steps_per_epoch` must be given."""
    if steps_per_epoch is None:
        raise ConfigError("steps_per_epoch=None, but parameter-server training needs it: workers read their "
                          "shards repeated forever and the chief schedules a fixed number of steps per epoch. "
                          "Fix: pass steps_per_epoch=N to trainer.fit, e.g. examples // global_batch_size")
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ConfigError(f"steps_per_epoch must be a positive integer: got {steps_per_epoch!r}. "
                          "Fix: e.g. steps_per_epoch=examples // global_batch_size")


def evaluate_locally(model: Any, data: Any, *, global_batch_size: int | None, steps: int | None = None,
                     strategy: Any = None) -> dict:
    """Evaluate `model` in this process over `data` once (or `steps` batches): loss and compiled metrics.

    `Trainer.evaluate` on a PS chief uses it (Keras' own `evaluate` refuses the
    strategy's datasets); the variables stay where they are (on the ps) and are
    read from here. `strategy`: the scope to create them in if the model is not
    built yet.
    """
    keras_ps.check(model)
    dataset = inputs.local_dataset(data, global_batch_size, steps)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        variables.build(model, inputs.batched_element_spec(dataset.element_spec, batched=True))
    return Metrics.of(model).evaluate(dataset)
