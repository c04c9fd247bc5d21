"""The coordinator loop on the chief: one scheduled closure per step, exact counts, one epoch at a time.

  * per-worker datasets through `ClusterCoordinator.create_per_worker_dataset`,
    each worker reading its own shard (`InputContext.input_pipeline_id` is the
    worker index) repeated forever, so a fixed number of steps is scheduled and
    no worker ever runs out of data (`stratkit.training.inputs`);
  * one closure per step: forward pass, `model.compute_loss`, the model's own
    optimizer, and the model's metrics (`metrics.Metrics`), scheduled with
    `schedule` and collected with `join` at the end of each epoch;
  * `optimizer.iterations` set to the exact step count (`variables.Counters`)
    at each epoch end.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import keras

from stratkit import status
from stratkit.strategy import keras_ps
from stratkit.training import inputs
from stratkit.training.ps import variables
from stratkit.training.ps.checkpoints import ChiefCheckpoints
from stratkit.training.ps.metrics import Metrics

log = status.logger(__name__)


class CoordinatorLoop:
    """Everything the chief keeps between epochs (and between fit calls on the same model)."""

    @classmethod
    def for_model(cls, trainer: Any, model: Any) -> "CoordinatorLoop":
        state = keras_ps.model_state(model)
        loop = state.loop
        # A new strategy, or a recompiled model (new optimizer, new metrics): start over.
        if loop is None or loop.strategy is not trainer.strategy or loop.optimizer is not model.optimizer:
            loop = state.loop = cls(trainer, model)
        return loop

    def __init__(self, trainer: Any, model: Any) -> None:
        import tensorflow as tf

        variables.check_model(model)
        self.trainer = trainer
        self.spec = trainer.spec
        self.strategy = trainer.strategy
        self.model = model
        self.optimizer = model.optimizer
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)  # one per strategy
        self.num_workers = len(self.spec.cluster.get("worker", ()))
        self._built_for: Any = None
        self._train_function: Any = None
        self._iterator: Any = None
        self._data: Any = None

    def _make_train_function(self) -> Any:
        import tensorflow as tf

        model, strategy, metrics, counters = self.model, self.strategy, self.metrics, self.counters
        targets = variables.optimizer_targets(model)

        def replica_step(batch: Any) -> list[Any]:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            with tf.GradientTape() as tape:
                y_pred = keras_ps.call_model(model, x, training=True)
                loss, deltas = metrics.step(x, y, sample_weight, y_pred, training=True)
                scaled = model.optimizer.scale_loss(loss)
            gradients = tape.gradient(scaled, targets)
            model.optimizer.apply_gradients(zip(gradients, targets))
            return deltas + [tf.cast(variables.batch_size(x), tf.int64)]

        @tf.function
        def train_step(iterator: Any) -> Any:
            per_replica = strategy.run(replica_step, args=(next(iterator),))
            totals = [strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) for value in per_replica]
            return counters.add(totals[:-1], totals[-1])

        return train_step

    @staticmethod
    def _worker_context(num_workers: int, num_replicas: int) -> Any:
        """The InputContext of the worker a closure runs on (the coordinator knows its index at call time)."""
        import tensorflow as tf

        def context() -> Any:
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=index,
                                              num_replicas_in_sync=num_replicas)

        return context

    def _prepare(self, data: Any, global_batch_size: int | None) -> None:
        """Build the model and the per-worker datasets once per (data, batch) pair."""
        key = (id(data), global_batch_size)
        if self._built_for == key:
            return
        replicas = int(self.strategy.num_replicas_in_sync)
        adapter = inputs.adapter_for(data)
        adapter.check_worker_shards(global_batch_size, self.num_workers, replicas)
        spec = adapter.batched_element_spec(self.num_workers, replicas)
        with self.strategy.scope():
            variables.build(self.model, spec)
        if self._train_function is None:
            self.metrics = Metrics.of(self.model)
            self.counters = variables.Counters(self.strategy, self.metrics.initial)
            self._train_function = self._make_train_function()
        dataset_fn = adapter.worker_dataset_fn(global_batch_size, self._worker_context(self.num_workers, replicas),
                                               getattr(self.trainer, "seed", inputs.DEFAULT_SEED))
        strategy = self.strategy
        per_worker = self.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn))
        self._iterator = iter(per_worker)
        self._data = data  # keep it alive: the key holds its id
        self._built_for = key

    def fit(self, data: Any, *, epochs: int, steps_per_epoch: int, validation_data: Any,
            global_batch_size: int | None, backup_dir: str | None, callbacks: Iterable[Any], verbose: Any,
            validation_steps: int | None) -> keras.callbacks.History:
        from stratkit.strategy.side_effects import default_verbose

        verbose = default_verbose(True) if verbose is None else verbose
        self._prepare(data, global_batch_size)
        if validation_data is not None:
            val_dataset = inputs.local_dataset(validation_data, global_batch_size, validation_steps)

        checkpoints = ChiefCheckpoints(backup_dir, has_evaluator="evaluator" in self.spec.cluster, epochs=epochs)
        initial_epoch = checkpoints.resume(self.model)
        # Count on from optimizer.iterations, exact at every epoch end (set below): 0 for a new model,
        # the previous fit's total, or the restored checkpoint's.
        scheduled = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.counters.steps.assign(scheduled)

        history = keras.callbacks.History()
        callback_list = keras.callbacks.CallbackList(
            list(callbacks or ()) + [history], add_history=False, add_progbar=False, model=self.model,
            verbose=verbose, epochs=epochs, steps=steps_per_epoch)
        self.model.stop_training = False
        callback_list.on_train_begin()
        last_epoch, logs = initial_epoch, None
        for epoch in range(initial_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            start = time.perf_counter()
            logs, steps_run = self._train_epoch(steps_per_epoch)
            seconds = time.perf_counter() - start
            if validation_data is not None:
                val = self.metrics.evaluate(val_dataset)
                logs.update({f"val_{name}": value for name, value in val.items()})
            scheduled += steps_per_epoch
            # Keras' own counter lost increments to concurrent non-atomic updates: set it to the exact count.
            self.model.optimizer.iterations.assign(self.counters.steps.read_value())
            checkpoints.save(self.model, epoch + 1)
            last_epoch = epoch + 1
            if verbose:
                _log_epoch(epoch, epochs, steps_run, seconds, logs)
            callback_list.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        callback_list.on_train_end(logs)
        checkpoints.finish(last_epoch)
        # Both count every step this model trained (earlier fits and a resumed run's first part too).
        # Equal, unless a worker died with a step in flight: that step may have been applied on the
        # ps before TensorFlow re-ran it elsewhere (at-least-once); the counter counts both.
        history.steps = int(self.counters.steps.numpy())
        history.steps_scheduled = scheduled
        history.initial_epoch = initial_epoch
        return history

    def _train_epoch(self, steps: int) -> tuple[dict[str, Any], int]:
        """Run one epoch: (its logs, the steps that ran, by the atomic counter on the ps)."""
        steps_before = self.counters.start_epoch()
        start = time.perf_counter()
        for _ in range(steps):
            self.coordinator.schedule(self._train_function, args=(self._iterator,))
        self.coordinator.join()  # raises if a closure failed for a reason other than a lost worker
        seconds = time.perf_counter() - start
        logs: dict[str, Any] = self.metrics.results(self.counters.epoch_sums())
        logs["examples_per_sec"] = float(self.counters.examples.numpy()) / max(seconds, 1e-9)
        return logs, int(self.counters.steps.numpy()) - steps_before


def _log_epoch(epoch: int, epochs: int, steps: int, seconds: float, logs: dict[str, Any]) -> None:
    values = " - ".join(f"{k}: {v:.4f}" for k, v in logs.items() if k != "examples_per_sec")
    log.info("epoch %d/%d: %d steps in %.2fs (%s examples/sec) - %s", epoch + 1, epochs, steps, seconds,
             f"{logs.get('examples_per_sec', 0.0):,.0f}", values)
