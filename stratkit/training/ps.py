"""Parameter-server training for Keras 3: the coordinator loop behind `Trainer.fit`.

Keras 3 has no ParameterServerStrategy path: `model.fit` refuses the
strategy's datasets and `DatasetCreator` is gone. On a PS cluster the same
user script runs on every task; `Trainer()` turns ps and worker tasks into
servers, and `trainer.fit` on the chief runs the loop below, on the evaluator
the sidecar evaluation (`stratkit.training.evaluator`).

The loop (chief only):
  * per-worker datasets through `ClusterCoordinator.create_per_worker_dataset`,
    each worker reading its own shard (`InputContext.input_pipeline_id` is the
    worker index) repeated forever, so a fixed number of steps is scheduled and
    no worker ever runs out of data;
  * one closure per step: forward pass, `model.compute_loss`, the model's own
    optimizer, and the model's metrics, scheduled with `schedule` and
    collected with `join` at the end of each epoch.

Exact counts under asynchronous updates: Keras 3 `Variable.assign_add` is
`assign(self + value)`, so concurrent workers lose increments (measured: 61
scheduled steps, `optimizer.iterations` 53). Steps, examples and every metric
variable are therefore accumulated in raw `tf.Variable`s whose `assign_add` is
one atomic kernel on the ps. A step computes its metric update without touching
the Keras metric variables (`keras.StatelessScope`: the update applied to the
reset state gives this batch's contribution), and adds that contribution
atomically. That is exact for metrics whose state is a sum (Mean, accuracy,
AUC, precision/recall, ... : every Keras metric variable with aggregation
"sum"). `optimizer.iterations` is set to the exact step count at each epoch end.

Files in `backup_dir` (written by the chief, read by the evaluator; atomic,
see `stratkit.training.backup`):
  epoch-00003.weights.h5   model + optimizer after epoch 3 (the last 2 kept)
  checkpoint.json          names the newest complete epoch file
  training-done.json       written when training ends and the cluster has an
                           evaluator: {"epoch": E, "file": ...}; the named
                           weights file is kept for the evaluator's last pass
  eval/                    the evaluator's TensorBoard summaries
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Iterable

import keras
import numpy as np

from stratkit.errors import ConfigError, KerasCompatError
from stratkit.strategy import keras_compat
from stratkit.training import backup as backup_lib

log = logging.getLogger(__name__)

DONE_FILE = "training-done.json"


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


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
    keras_compat.check_parameter_server(model)  # an unsupported Keras fails here, not deep in a step
    check_steps_per_epoch(steps_per_epoch)
    spec = trainer.spec
    if spec.task_type == "evaluator":
        from stratkit.training.evaluator import run_sidecar_evaluation

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
    loop = _CoordinatorLoop.for_model(trainer, model)
    return loop.fit(data, epochs=epochs, steps_per_epoch=int(steps_per_epoch), validation_data=validation_data,
                    global_batch_size=global_batch_size,
                    backup_dir=None if backup_dir is None else os.fspath(backup_dir), callbacks=callbacks,
                    verbose=verbose, validation_steps=validation_steps)


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
    import contextlib

    import tensorflow as tf

    dataset = _local_dataset(data, global_batch_size, steps)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        _build(model, _batched_spec(dataset.element_spec, batched=True))
    return _Metrics.of(model).evaluate(dataset, tf)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _is_dataset(obj: Any) -> bool:
    import tensorflow as tf

    return isinstance(obj, tf.data.Dataset)


def _is_dataset_fn(data: Any) -> bool:
    return callable(data) and not _is_dataset(data) and not isinstance(data, (tuple, list, dict))


def _numpy_dataset(data: Any):
    import tensorflow as tf

    from stratkit.training.data import _numpy_arrays

    arrays = _numpy_arrays(data)
    return tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])


def _need_batch(global_batch_size: int | None, what: str) -> int:
    if global_batch_size is None:
        raise ConfigError(f"{what} needs a batch size. Fix: pass global_batch_size=N (examples per step) or "
                          "per_replica_batch_size=N to trainer.fit")
    return int(global_batch_size)


def _serialized(dataset: Any) -> tuple[Any, Any]:
    """The dataset as a GraphDef string, so each worker rebuilds it locally.

    A dataset made on the chief lives in the chief's memory; a function run on a
    worker cannot read it, but it can rebuild it from its graph.
    """
    import tensorflow as tf

    graph = tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor,  # noqa: SLF001
                                        external_state_policy=0, strip_device_assignment=True)
    return graph, dataset.element_spec


def _worker_dataset_fn(data: Any, global_batch_size: int | None, num_workers: int, num_replicas: int,
                       seed: int) -> Callable[[Any], Any]:
    """dataset_fn(ps_input_context) run on each worker: its own shard, repeated forever, batched.

    ParameterServerStrategy hands every worker the same InputContext (pipeline 0
    of 1); the worker's real index comes from the coordinator at call time.
    """
    import tensorflow as tf

    def context() -> Any:
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        return tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=index,
                                          num_replicas_in_sync=num_replicas)

    from stratkit.training.data import _repeating_fn, batch_size_of

    if _is_dataset_fn(data):
        repeating = _repeating_fn(data)
        return lambda _: repeating(context())

    global_batch = _need_batch(global_batch_size, "data given as arrays or a tf.data.Dataset")
    batched = batch_size_of(data)
    if _is_dataset(data):
        graph, spec = _serialized(data)
        shuffle = False  # the user's dataset decides its own order
    else:
        graph, spec = _serialized(_numpy_dataset(data))
        shuffle = True

    def from_data(_: Any) -> Any:
        ctx = context()
        dataset = tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)
        dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)  # whole batches if batched
        batch = ctx.get_per_replica_batch_size(global_batch)
        if batched is not None:
            # Batched by the user with the global batch: one batch is one step; split it only
            # when a worker has several replicas (rebatch, not unbatch + batch).
            dataset = dataset.repeat() if batch == global_batch else dataset.repeat().rebatch(batch)
            return dataset.prefetch(tf.data.AUTOTUNE)
        if shuffle:
            # Each worker shuffles its own shard, reshuffled each pass. The seed is a Python int:
            # a tensor seed (e.g. seed + the worker's index) crashes TF's get_seed when the global
            # seed is 0, as after keras.utils.set_random_seed(0) (it tests `seeds == (0, 0)`).
            dataset = dataset.shuffle(4096, seed=seed, reshuffle_each_iteration=True)
        return dataset.repeat().batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    return from_data


def _check_shards(data: Any, global_batch_size: int | None, num_workers: int, num_replicas: int) -> None:
    """Every worker's shard must hold at least one step, or its repeated stream is empty."""
    from stratkit.training.data import _numpy_arrays, batch_size_of

    if _is_dataset_fn(data) or global_batch_size is None or num_workers < 1:
        return
    if _is_dataset(data):
        size = int(data.cardinality())
        if size < 0:
            return  # infinite or unknown: nothing to check here
    else:
        first = _numpy_arrays(data)[0]
        size = len(next(iter(first.values())) if isinstance(first, dict) else first)
    if batch_size_of(data) is not None:
        if size < num_workers:
            raise ConfigError(f"data has {size} batch(es), fewer than the {num_workers} workers that each read "
                              "their own share of the batches: a worker would have none. Fix: pass more data, or "
                              "pass it unbatched (stratkit then shards examples, not batches)")
        return
    per_step = global_batch_size // max(num_replicas, 1)
    if size // num_workers < per_step:
        raise ConfigError(f"data has {size} examples: each of the {num_workers} workers reads {size // num_workers}, "
                          f"fewer than one step's batch of {per_step} (global_batch_size={global_batch_size}). "
                          f"Fix: use global_batch_size <= {max(size // num_workers, 1) * max(num_replicas, 1)}, "
                          "or pass more data")


def _element_spec_for_build(data: Any, global_batch_size: int | None, num_workers: int, num_replicas: int) -> Any:
    """The batched element spec of the training data, read on the chief without running it."""
    import tensorflow as tf

    if _is_dataset_fn(data):
        ctx = tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=0,
                                         num_replicas_in_sync=num_replicas)
        return _batched_spec(data(ctx).element_spec, batched=True)
    from stratkit.training.data import batch_size_of

    dataset = data if _is_dataset(data) else _numpy_dataset(data)
    return _batched_spec(dataset.element_spec, batched=batch_size_of(data) is not None)


def _batched_spec(element_spec: Any, *, batched: bool) -> Any:
    import tensorflow as tf

    def one(spec: Any) -> Any:
        shape = spec.shape if batched else tf.TensorShape([None]).concatenate(spec.shape)
        return tf.TensorSpec(shape, spec.dtype)

    return tf.nest.map_structure(one, element_spec)


def _local_dataset(data: Any, global_batch_size: int | None, steps: int | None) -> Any:
    """The validation data as one local, finite, batched dataset (evaluated once)."""
    import tensorflow as tf

    from stratkit.training.data import local_batches

    if _is_dataset_fn(data):
        dataset = data(tf.distribute.InputContext())
    else:
        dataset = local_batches(data, global_batch_size, "validation_data as arrays or a tf.data.Dataset")
    if steps is not None:
        dataset = dataset.take(int(steps))
    elif int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ConfigError("validation_data is an infinite dataset and validation_steps=None. Fix: pass "
                          "validation_steps=N, or make the validation dataset finite")
    return dataset.prefetch(tf.data.AUTOTUNE)


# --------------------------------------------------------------------------------------------
# The model and its metrics
# --------------------------------------------------------------------------------------------


def _build(model: Any, element_spec: Any) -> None:
    """Create every variable (model, compiled loss and metrics, optimizer) before training.

    Variables must exist before any closure runs: a scheduled function on a
    worker cannot create them. Keras' own fit does this with `_symbolic_build`
    (symbolic tensors only, no op runs); call it in the strategy's scope. The
    optimizer is built over `_optimizer_targets`, so a variable split by a
    `variable_partitioner` gets one slot per shard, on that shard's ps.
    """
    symbolic_build = getattr(model, "_symbolic_build", None)
    if symbolic_build is None:  # pragma: no cover - Keras moved its internals
        raise KerasCompatError(f"Keras {keras.__version__} has no Model._symbolic_build, which stratkit uses to "
                               "create the model's variables before parameter-server training. Fix: install "
                               "a Keras 3 version stratkit was tested on (3.15.1)")
    optimizer = model.optimizer
    build_optimizer = optimizer is not None and not optimizer.built
    if build_optimizer:
        optimizer.built = True  # keep _symbolic_build from building it over the unsplit variables
    try:
        symbolic_build(data_batch=tuple(element_spec) if isinstance(element_spec, list) else element_spec)
    finally:
        if build_optimizer:
            optimizer.built = False
    if build_optimizer:
        optimizer.build(_optimizer_targets(model))


def _optimizer_targets(model: Any) -> list[Any]:
    """The variables the optimizer updates: the model's, with each sharded one replaced by its shards.

    A `variable_partitioner` makes a Keras variable hold a `ShardedVariable`,
    which Keras 3 cannot differentiate or update (`'ShardedVariable' object has
    no attribute 'handle'`; ParameterServerStrategy updates only single
    variables). Its shards are plain variables, each on its own ps: gradients
    and optimizer updates go to them directly.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    targets: list[Any] = []
    for variable in model.trainable_variables:
        value = getattr(variable, "value", None)
        if isinstance(value, ShardedVariable):
            _allow_saving_sharded()
            targets.extend(value.variables)
        else:
            targets.append(variable)
    return targets


def _allow_saving_sharded() -> None:
    """Let Keras save a sharded variable: it reads weights with `np.asarray(variable)`.

    TensorFlow's ShardedVariable converts to a tensor (its shards concatenated)
    but has no `__array__`; adding one changes nothing else. Loading already
    works (`ShardedVariable.assign` splits the value over the shards).
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    if "__array__" in vars(ShardedVariable):
        return
    import tensorflow as tf

    def __array__(self: Any, dtype: Any = None, copy: Any = None) -> np.ndarray:  # noqa: N807
        return np.asarray(tf.convert_to_tensor(self).numpy(), dtype=dtype)

    ShardedVariable.__array__ = __array__


def _check_model(model: Any) -> None:
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover - Keras moved its internals: skip the check
        TensorFlowTrainer = None
    if TensorFlowTrainer is not None and getattr(type(model), "train_step", None) is not TensorFlowTrainer.train_step:
        raise ConfigError(f"{type(model).__name__} overrides train_step, which parameter-server training cannot run: "
                          "its metric updates are not atomic across asynchronous workers. Fix: move custom loss "
                          "logic into compute_loss and custom metrics into compute_metrics (both are used), or train "
                          "with another strategy")
    if getattr(model, "optimizer", None) is None:
        raise ConfigError("the model is not compiled with an optimizer. Fix: call model.compile(optimizer=..., "
                          "loss=...) inside the function passed to trainer.build")


def _unscale(loss: Any) -> Any:
    try:
        from keras.src.losses.loss import unscale_loss_for_distribution
    except ImportError:  # pragma: no cover
        return loss
    return unscale_loss_for_distribution(loss)


def _batch_size(x: Any) -> Any:
    import tensorflow as tf

    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


class _Metrics:
    """The model's metrics (loss tracker, compiled and custom), updated by deltas.

    `step` runs the model's loss and metric code against the *reset* metric
    state inside a `keras.StatelessScope`, so nothing is written to the Keras
    variables; the new state minus the reset state is this batch's
    contribution, which the caller sums (atomically on the ps, or locally).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.variables = list(model.metrics_variables)
        model.reset_metrics()
        self.initial = [np.asarray(keras.ops.convert_to_numpy(v)) for v in self.variables]
        self.names = [v.path for v in self.variables]
        odd = sorted({v.path for v in self.variables if str(getattr(v, "aggregation", "sum")) != "sum"})
        if odd:
            log.warning("metric variable(s) %s are not sums (aggregation != 'sum'): stratkit adds their per-step "
                        "updates, so their epoch values may be approximate under asynchronous training", odd)

    @classmethod
    def of(cls, model: Any) -> "_Metrics":
        cached = getattr(model, "_stratkit_ps_metrics", None)
        if cached is None or [id(v) for v in cached.variables] != [id(v) for v in model.metrics_variables]:
            cached = cls(model)
            model._stratkit_ps_metrics = cached  # noqa: SLF001 - one per model, rebuilt when its metrics change
        return cached

    def step(self, x: Any, y: Any, sample_weight: Any, y_pred: Any, training: bool) -> tuple[Any, list[Any]]:
        """(loss for the gradient, per-variable metric deltas) for one batch."""
        import tensorflow as tf

        from stratkit.strategy import keras_compat

        model = self.model
        mapping = [(v, tf.constant(value)) for v, value in zip(self.variables, self.initial)]
        # Read outside the scope: add_loss losses of the forward pass and the weights' regularization.
        extra_losses = list(model.losses)
        with keras.StatelessScope(state_mapping=mapping) as scope, \
                keras_compat.model_losses_override(model, extra_losses):
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,  # noqa: SLF001
                                       training=training)
            if model._loss_tracker is not None:  # noqa: SLF001
                model._loss_tracker.update_state(_unscale(loss), sample_weight=_batch_size(x))  # noqa: SLF001
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        deltas = []
        for (variable, reset) in mapping:
            new = scope.get_current_value(variable)
            deltas.append(tf.zeros_like(reset) if new is None else tf.cast(new, reset.dtype) - reset)
        return loss, deltas

    def results(self, deltas: list[Any]) -> dict[str, Any]:
        """The metrics' values for accumulated deltas (what `model.fit` logs)."""
        import tensorflow as tf

        mapping = [(v, tf.constant(init + np.asarray(d, dtype=init.dtype)))
                   for v, init, d in zip(self.variables, self.initial, deltas)]
        with keras.StatelessScope(state_mapping=mapping):
            logs = self.model.get_metrics_result()
        out: dict[str, Any] = {}
        for name, value in logs.items():
            array = np.asarray(keras.ops.convert_to_numpy(value))
            out[name] = float(array) if array.ndim == 0 else array.tolist()
        return out

    def evaluate(self, dataset: Any, tf: Any) -> dict[str, Any]:
        """One local pass over a finite batched dataset (no training)."""
        model = self.model

        def test_step(batch: Any) -> list[Any]:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            y_pred = model(x, training=False) if model._call_has_training_arg else model(x)  # noqa: SLF001
            return self.step(x, y, sample_weight, y_pred, training=False)[1]

        function = getattr(model, "_stratkit_test_function", None)
        if function is None or function[0] is not self:
            function = (self, tf.function(test_step, reduce_retracing=True))
            model._stratkit_test_function = function  # noqa: SLF001
        totals = [np.zeros_like(init) for init in self.initial]
        for batch in dataset:
            for i, delta in enumerate(function[1](batch)):
                totals[i] = totals[i] + delta.numpy()
        return self.results(totals)


# --------------------------------------------------------------------------------------------
# The coordinator loop
# --------------------------------------------------------------------------------------------


class _CoordinatorLoop:
    """Everything the chief keeps between epochs (and between fit calls on the same model)."""

    @classmethod
    def for_model(cls, trainer: Any, model: Any) -> "_CoordinatorLoop":
        loop = getattr(model, "_stratkit_ps_loop", None)
        # A new strategy, or a recompiled model (new optimizer, new metrics): start over.
        if loop is None or loop.strategy is not trainer.strategy or loop.optimizer is not model.optimizer:
            loop = cls(trainer, model)
            model._stratkit_ps_loop = loop  # noqa: SLF001
        return loop

    def __init__(self, trainer: Any, model: Any) -> None:
        import tensorflow as tf

        _check_model(model)
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

    # -- state on the ps -------------------------------------------------------------------------
    def _create_state(self) -> None:
        """The atomic counters, on the ps: steps, examples, one accumulator per metric variable."""
        import tensorflow as tf

        self.metrics = _Metrics.of(self.model)
        with self.strategy.scope():
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="stratkit_steps")
            # Colocated with the step counter: small, and never split by a variable_partitioner.
            with self.strategy.extended.colocate_vars_with(self.steps):
                self.examples = tf.Variable(0, dtype=tf.int64, trainable=False, name="stratkit_examples")
                self.sums = [tf.Variable(np.zeros_like(init), trainable=False, name=f"stratkit_sum_{i}")
                             for i, init in enumerate(self.metrics.initial)]

    def _make_train_function(self) -> Any:
        import tensorflow as tf

        model, strategy, metrics = self.model, self.strategy, self.metrics
        targets = _optimizer_targets(model)

        def replica_step(batch: Any) -> list[Any]:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
                loss, deltas = metrics.step(x, y, sample_weight, y_pred, training=True)
                scaled = model.optimizer.scale_loss(loss)
            gradients = tape.gradient(scaled, targets)
            model.optimizer.apply_gradients(zip(gradients, targets))
            return deltas + [tf.cast(_batch_size(x), tf.int64)]

        @tf.function
        def train_step(iterator: Any) -> Any:
            per_replica = strategy.run(replica_step, args=(next(iterator),))
            totals = [strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) for value in per_replica]
            # Raw tf.Variable.assign_add: one locked kernel on the ps, exact under concurrent workers.
            for total, value in zip(self.sums, totals[:-1]):
                total.assign_add(value)
            self.examples.assign_add(totals[-1])
            return self.steps.assign_add(1)

        return train_step

    def _prepare(self, data: Any, global_batch_size: int | None) -> None:
        """Build the model and the per-worker datasets once per (data, batch) pair."""
        key = (id(data), global_batch_size)
        if self._built_for == key:
            return
        from stratkit.training.data import DEFAULT_SEED

        replicas = int(self.strategy.num_replicas_in_sync)
        _check_shards(data, global_batch_size, self.num_workers, replicas)
        spec = _element_spec_for_build(data, global_batch_size, self.num_workers, replicas)
        with self.strategy.scope():
            _build(self.model, spec)
        if self._train_function is None:
            self._create_state()
            self._train_function = self._make_train_function()
        dataset_fn = _worker_dataset_fn(data, global_batch_size, self.num_workers, replicas,
                                        getattr(self.trainer, "seed", DEFAULT_SEED))
        strategy = self.strategy
        per_worker = self.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn))
        self._iterator = iter(per_worker)
        self._data = data  # keep it alive: the key holds its id
        self._built_for = key

    # -- fit -----------------------------------------------------------------------------------------
    def fit(self, data: Any, *, epochs: int, steps_per_epoch: int, validation_data: Any,
            global_batch_size: int | None, backup_dir: str | None, callbacks: Iterable[Any], verbose: Any,
            validation_steps: int | None) -> keras.callbacks.History:
        from stratkit.training.callbacks import default_verbose

        verbose = default_verbose(True) if verbose is None else verbose
        self._prepare(data, global_batch_size)
        if validation_data is not None:
            val_dataset = _local_dataset(validation_data, global_batch_size, validation_steps)

        checkpoints = _ChiefCheckpoints(backup_dir, has_evaluator="evaluator" in self.spec.cluster, epochs=epochs)
        initial_epoch = checkpoints.resume(self.model)
        # Count on from optimizer.iterations, exact at every epoch end (set below): 0 for a new model,
        # the previous fit's total, or the restored checkpoint's.
        scheduled = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.steps.assign(scheduled)

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
                val = self.metrics.evaluate(val_dataset, _tf())
                logs.update({f"val_{name}": value for name, value in val.items()})
            scheduled += steps_per_epoch
            # Keras' own counter lost increments to concurrent non-atomic updates: set it to the exact count.
            self.model.optimizer.iterations.assign(self.steps.read_value())
            checkpoints.save(self.model, epoch + 1)
            last_epoch = epoch + 1
            if verbose:
                _print_epoch(epoch, epochs, steps_run, seconds, logs)
            callback_list.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        callback_list.on_train_end(logs)
        checkpoints.finish(last_epoch)
        # Both count every step this model trained (earlier fits and a resumed run's first part too).
        # Equal, unless a worker died with a step in flight: that step may have been applied on the
        # ps before TensorFlow re-ran it elsewhere (at-least-once); the counter counts both.
        history.steps = int(self.steps.numpy())
        history.steps_scheduled = scheduled
        history.initial_epoch = initial_epoch
        return history

    def _train_epoch(self, steps: int) -> tuple[dict[str, Any], int]:
        """Run one epoch: (its logs, the steps that ran, by the atomic counter on the ps)."""
        for total, init in zip(self.sums, self.metrics.initial):
            total.assign(np.zeros_like(init))
        self.examples.assign(0)
        steps_before = int(self.steps.numpy())
        start = time.perf_counter()
        for _ in range(steps):
            self.coordinator.schedule(self._train_function, args=(self._iterator,))
        self.coordinator.join()  # raises if a closure failed for a reason other than a lost worker
        seconds = time.perf_counter() - start
        logs: dict[str, Any] = self.metrics.results([total.numpy() for total in self.sums])
        logs["examples_per_sec"] = float(self.examples.numpy()) / max(seconds, 1e-9)
        return logs, int(self.steps.numpy()) - steps_before


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _print_epoch(epoch: int, epochs: int, steps: int, seconds: float, logs: dict[str, Any]) -> None:
    values = " - ".join(f"{k}: {v:.4f}" for k, v in logs.items() if k != "examples_per_sec")
    print(f"[stratkit] epoch {epoch + 1}/{epochs}: {steps} steps in {seconds:.2f}s "
          f"({logs.get('examples_per_sec', 0.0):,.0f} examples/sec) - {values}", flush=True)


# --------------------------------------------------------------------------------------------
# Checkpoints in backup_dir
# --------------------------------------------------------------------------------------------


class _ChiefCheckpoints:
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
        if self.directory is None:
            return 0
        backup_lib.prepare_dir(self.directory)
        done = read_done_marker(self.directory)
        if done is not None:
            # A previous run's end: not this run's (the evaluator ignores markers older than itself). The
            # file it kept for the evaluator goes too, unless it is also this run's resume point.
            _remove(os.path.join(self.directory, DONE_FILE))
            kept = str(done.get("file", ""))
            if backup_lib.is_epoch_file(kept) and done.get("epoch") != backup_lib.latest_epoch(self.directory):
                _remove(os.path.join(self.directory, kept))
        point = backup_lib.find_resume_point(self.directory)
        if point.note:
            backup_lib.warn(point.note)
        if point.epoch == 0:
            return 0
        backup_lib.load(model, point)
        print(f"[stratkit] resumed from {point.path} at epoch {point.epoch}", flush=True)
        self.past_end = backup_lib.past_end(point.epoch, self.epochs, self.directory)
        return point.epoch

    def save(self, model: Any, epoch: int) -> None:
        if self.directory is not None:
            backup_lib.save_epoch(model, self.directory, epoch)

    def finish(self, epoch: int) -> None:
        if self.directory is None:
            return
        keep = backup_lib.weights_path(self.directory, epoch) if self.has_evaluator and epoch > 0 else None
        if keep is not None and os.path.exists(keep):
            _atomic_json(os.path.join(self.directory, DONE_FILE),
                         {"epoch": epoch, "file": os.path.basename(keep), "time": time.time()})
        if self.past_end:
            return  # nothing was trained: the backup stays
        backup_lib.remove_backup(self.directory, keep=keep)
        try:
            os.rmdir(self.directory)  # only if nothing of the user's (or the evaluator's) is left in it
        except OSError:
            pass


def read_done_marker(directory: str) -> dict | None:
    """The chief's end-of-training marker in `directory`, or None (not through a symlink, only ours)."""
    from stratkit.training import files

    try:
        marker = json.loads(files.read_bytes(os.path.join(directory, DONE_FILE), f"backup_dir={directory!r}"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "epoch" in marker and "file" in marker else None


def _atomic_json(path: str, value: dict) -> None:
    from stratkit.training import files

    files.write_bytes(path, json.dumps(value).encode())


def _remove(path: str) -> None:
    from stratkit.training import files

    files.remove(path)
