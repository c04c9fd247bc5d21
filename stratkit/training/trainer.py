"""`Trainer`: one build + fit that runs unchanged on one device, several local
devices, N workers, and every task of a parameter-server cluster.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable

from stratkit.cluster import ClusterSpec, detect
from stratkit.errors import ConfigError

log = logging.getLogger(__name__)


class Trainer:
    """Build and train a Keras model under the strategy the environment calls for.

    Args:
        strategy: an explicit strategy kind ("one_device", "mirrored",
            "multi_worker_mirrored", "parameter_server", "tpu"); beats detection.
        spec: a `ClusterSpec` (default: `stratkit.detect(strategy=strategy)`).
        seed: shuffle seed for numpy inputs; the same on every worker.
        gradient_compression: None (default), "bf16" or "fp16": the dtype
            gradients are all-reduced in (see `stratkit.make_strategy`).
        **strategy_options: passed to `stratkit.make_strategy` (e.g.
            `logical_cpus=2`, `timeout_seconds=600`, `variable_partitioner=...`).

    The strategy is created in the constructor, so create the Trainer before
    any other TensorFlow op. On the ps and worker tasks of a parameter-server
    cluster the constructor serves the task and exits the process when the
    chief finishes (no `if` needed in the user's script).
    """

    def __init__(self, strategy: str | None = None, spec: ClusterSpec | None = None, *, seed: int | None = None,
                 gradient_compression: str | None = None, **strategy_options: Any) -> None:
        from stratkit.strategy.factory import _override, make_strategy

        if spec is None:
            spec = detect(strategy=strategy)
        elif strategy is not None:
            spec = _override(spec, strategy)
        self.spec: ClusterSpec = spec
        self.strategy = make_strategy(spec, gradient_compression=gradient_compression, **strategy_options)
        from stratkit.training.inputs import DEFAULT_SEED

        self.seed = DEFAULT_SEED if seed is None else int(seed)

    # -- properties ---------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """Replicas that train in sync (GPUs x workers; 1 per CPU worker)."""
        return int(self.strategy.num_replicas_in_sync)

    @property
    def is_chief(self) -> bool:
        """True on the task that saves, logs and prints the progress bar."""
        return self.spec.is_chief

    @property
    def _ps(self) -> bool:
        return self.spec.strategy == "parameter_server"

    # -- build ----------------------------------------------------------------------
    def build(self, build_and_compile: Callable[[], Any]) -> Any:
        """Call `build_and_compile()` inside the strategy's scope and return the compiled model."""
        import keras

        with self.strategy.scope():
            model = build_and_compile()
        _check_not_legacy_keras(model)
        if not isinstance(model, keras.Model):
            raise ConfigError(f"build_and_compile returned {type(model).__name__}, not a keras.Model. Fix: return "
                              "the model from the function passed to trainer.build")
        if not getattr(model, "compiled", False) and getattr(model, "optimizer", None) is None:
            raise ConfigError("the model returned by build_and_compile is not compiled. Fix: call model.compile("
                              "optimizer=..., loss=...) inside the function, so the optimizer's variables are "
                              "created under the strategy")
        if not self._ps:
            from stratkit.strategy import keras_compat

            keras_compat.check_steps_per_execution(model, self.strategy)
            keras_compat.check_stateful_rnn(model, self.strategy)
            keras_compat.check_jit_compile(model, self.strategy)
        return model

    # -- fit ------------------------------------------------------------------------
    def fit(self, model: Any, data: Any, epochs: int = 1, steps_per_epoch: int | None = None,
            validation_data: Any = None, global_batch_size: int | None = None,
            per_replica_batch_size: int | None = None, backup_dir: str | None = None,
            callbacks: Iterable[Any] = (), scale_learning_rate: bool = False, warmup_epochs: int = 0,
            verbose: Any = None, validation_steps: int | None = None, shuffle: bool = True, *,
            validation_split: float = 0.0, class_weight: dict | None = None, sample_weight: Any = None,
            y: Any = None, batch_size: int | None = None, initial_epoch: int = 0, validation_freq: Any = 1,
            validation_batch_size: int | None = None, backup_every: int | str | None = None,
            **others: Any) -> Any:
        """Train `model` on `data` with the global batch split over every replica.

        Args:
            model: from `trainer.build`.
            data: `(x, y)` / `(x, y, sample_weight)` numpy arrays, a `tf.data.Dataset`
                (unbatched, or batched with the global batch), `dataset_fn(input_context)`
                returning a per-replica-batched dataset, or a `keras.utils.PyDataset`
                (its batch is the global batch). A Python generator is refused (it
                cannot be read exactly; the message says what to pass instead).
            epochs: total epochs (a resumed run continues to this number).
            steps_per_epoch: steps per epoch (required with dataset_fn and on PS):
                exactly this many run every epoch, the data repeated as needed;
                None: one pass over the data per epoch.
            validation_data: same forms as `data`.
            global_batch_size: examples per step across all replicas. Give
                exactly one of it and `per_replica_batch_size` (global =
                per_replica x num_replicas); neither for a batched dataset (its
                batch is the global batch).
            per_replica_batch_size: examples per step on each replica.
            backup_dir: back up every epoch (or as `backup_every` says) and resume there after a failure; a
                preemption notice (SIGTERM, or STRATKIT_PREEMPTION_SIGNAL; USR1 in a Slurm job) then makes every
                worker stop at the same step, back up and exit with status 75 (see `stratkit.training.checkpoint`).
                A directory every worker reads, or a store URL (``s3://bucket/run``, ``gs://``, ``az://``,
                ``hdfs://``; checked before step 1): each worker then writes locally and uploads beside training,
                and a resume takes the newest backup committed to the store (docs/storage.md).
            callbacks: Keras callbacks; TensorBoard/ModelCheckpoint write only
                on the chief (other workers write to temp dirs).
            scale_learning_rate: multiply the compiled learning rate by
                `num_replicas` (linear scaling rule) ...
            warmup_epochs: ... reached gradually over this many epochs.
            verbose: Keras verbosity; default: progress on the chief only.
            shuffle: reshuffle numpy arrays each epoch (one seed on every worker).
            validation_steps: batches of `validation_data` per validation (None: all of it).
            validation_split: as in `model.fit` (array data only).
            class_weight: as in `model.fit`.
            sample_weight: as in `model.fit` (joined to array data).
            y: as in `model.fit` (joined to array data).
            batch_size: as in `model.fit`: the global batch.
            initial_epoch: as in `model.fit`.
            validation_freq: as in `model.fit`.
            validation_batch_size: as in `model.fit`.
            backup_every: with `backup_dir`: back up every K global steps (an int) or at the first step after
                a duration ("30s", "10min", "1h", the chief's clock) instead of after every epoch; a resume
                then continues at that step, reading the batches an uninterrupted run reads.
            **others: any other keyword is a `ConfigError`. How each of
                `model.fit`'s arguments is honoured: `stratkit.training.fit_args`.

        Returns:
            The `keras.callbacks.History` (on PS also with `.steps`, the exact step
            count; see `stratkit.training.ps.fit_parameter_server`).
        """
        from stratkit.strategy import side_effects
        from stratkit.training import callbacks as cb
        from stratkit.training import fit_args
        from stratkit.training.inputs import is_dataset_fn, is_py_dataset, prepare, resolve_global_batch_size
        from stratkit.training.inputs import table as table_rules

        from stratkit.training.checkpoint import Backup, Position, check_every, resumable_input_for

        fit_args.refuse_unknown(others)
        fit_args.check_epochs(epochs)
        every = check_every(backup_every, backup_dir)
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ConfigError(f"steps_per_epoch must be a positive integer or None: got {steps_per_epoch!r}")
        global_batch_size = fit_args.merge_batch_size(batch_size, global_batch_size)
        data = fit_args.join_arrays(data, y, sample_weight)
        fit_args.check_class_weight(class_weight, data)
        data, validation_data = fit_args.split_validation(data, validation_split, validation_data)
        fit_args.check_elastic(os.environ, global_batch_size, per_replica_batch_size, self.num_replicas,
                               max(self.spec.num_workers, 1), scale_learning_rate)
        global_batch = resolve_global_batch_size(global_batch_size, per_replica_batch_size, self.num_replicas,
                                                 required=not is_dataset_fn(data), data=data)
        table_rules.refuse(data, class_weight=class_weight)
        if class_weight is not None and is_dataset_fn(data):
            raise ConfigError("class_weight cannot be applied to a dataset_fn's distributed dataset. Fix: yield "
                              "(x, y, sample_weight) from the dataset_fn, with each row's class weight as its "
                              "sample weight")
        if self._ps:
            from stratkit.training.ps import fit_parameter_server

            if every.per_step:
                raise ConfigError(f"backup_every={backup_every!r}: parameter-server training backs up after every "
                                  "epoch (its steps run asynchronously on the workers). Fix: drop backup_every")
            fit_args.refuse_on_parameter_servers(class_weight=class_weight, initial_epoch=initial_epoch,
                                                 validation_freq=validation_freq,
                                                 validation_batch_size=validation_batch_size)
            from stratkit.data import TableInput

            if isinstance(data, TableInput) or isinstance(validation_data, TableInput):
                raise ConfigError("a stratkit.data.TableInput cannot be read by parameter-server training (yet). "
                                  "Fix: train with a synchronous strategy (MultiWorkerMirrored: stratkit launch, "
                                  "LocalRunner, Spark, Ray), or pass a dataset_fn(input_context)")
            if is_py_dataset(data) or is_py_dataset(validation_data):
                raise ConfigError("a keras.utils.PyDataset cannot be read by parameter-server training (each "
                                  "worker builds its own tf.data pipeline). Fix: pass numpy arrays, a "
                                  "tf.data.Dataset, or a dataset_fn(input_context)")

            return fit_parameter_server(self, model, data, epochs=epochs, steps_per_epoch=steps_per_epoch,
                                        validation_data=validation_data, global_batch_size=global_batch,
                                        backup_dir=backup_dir, callbacks=callbacks, verbose=verbose,
                                        validation_steps=validation_steps)
        tpu = self.spec.strategy == "tpu"
        backup, position = None, Position(initial_epoch or 0)
        if backup_dir is not None:
            backup = Backup(os.fspath(backup_dir), backup_every, is_chief=self.is_chief,
                            rank=max(self.spec.worker_rank, 0), agree_on_epoch=self._min_over_workers)
            position = max(backup.decide_position(), position)
            data = resumable_input_for(data, position, backup.saved_data, backup_dir=backup.backup_dir)
        # Where training starts fixes the data order of every epoch after it (numpy arrays) and the batch the
        # first one starts at (a step backup).
        train = prepare(data, strategy=self.strategy, num_replicas=self.num_replicas,
                        global_batch_size=global_batch, steps_per_epoch=steps_per_epoch, training=True,
                        shuffle=shuffle, seed=self.seed, tpu=tpu, first_epoch=position.epoch,
                        first_step=position.step, model=model)
        val = None
        if validation_data is not None:
            val_batch = None if is_py_dataset(validation_data) else global_batch
            if validation_batch_size is not None:
                val_batch = resolve_global_batch_size(validation_batch_size, None, self.num_replicas, required=True,
                                                      data=validation_data)
            prepared_val = prepare(validation_data, strategy=self.strategy, num_replicas=self.num_replicas,
                                   global_batch_size=val_batch, steps_per_epoch=validation_steps, training=False,
                                   tpu=tpu, model=model)
            val = prepared_val.dataset
            if validation_steps is None and prepared_val.kind == "table":  # one pass, as many steps on every worker
                validation_steps = prepared_val.steps_per_epoch
        if backup is not None:  # a resume that cannot continue the backup's run is refused here, before training
            backup.bind_input(data, train, world_size=max(self.spec.num_workers, 1), replicas=self.num_replicas)
            if shuffle and train.kind == "dataset" and not train.endless:
                backup.resume_note = _RESHUFFLED
            elif train.kind == "table" and getattr(data, "note", None):
                backup.resume_note = f"the table's order changed at this resume: {data.note}"

        if warmup_epochs and not scale_learning_rate:
            raise ConfigError(f"warmup_epochs={warmup_epochs} only applies with scale_learning_rate=True. "
                              "Fix: pass scale_learning_rate=True, or drop warmup_epochs")
        # the last step before the try: other workers' file writers now point into private dirs until its finally
        callback_list, temps = side_effects.route_side_effects(callbacks, self.is_chief)
        if scale_learning_rate:
            callback_list.insert(0, cb.LinearScalingWarmup(self.num_replicas, warmup_epochs,
                                                           train.steps_per_epoch or steps_per_epoch))
        if train.global_batch_size:
            rows, batch = train.num_examples, train.global_batch_size
            one_pass = steps_per_epoch is None and rows and train.steps_per_epoch == -(-rows // batch)
            callback_list.append(cb.Throughput(batch, verbose=self.is_chief, epoch_examples=rows if one_pass else None,
                                               epoch_steps=train.steps_per_epoch))
        for callback in callback_list:  # a run's logger records the global batch (stratkit.callbacks.MLflowLogger)
            if callable(getattr(callback, "set_global_batch_size", None)):
                callback.set_global_batch_size(train.global_batch_size)
        from stratkit import timeline

        if timeline.enabled():
            callback_list.append(cb.PhaseMarks())
        if backup is not None:
            callback_list.insert(0, backup)
        from_table = train.kind == "table" or (val is not None and prepared_val.kind == "table")
        try:
            with table_rules.untraced(model, from_table):
                return model.fit(train.dataset, epochs=epochs,
                                 steps_per_epoch=train.steps_per_epoch if train.endless else steps_per_epoch,
                                 validation_data=val, validation_steps=validation_steps, callbacks=callback_list,
                                 shuffle=False,
                                 verbose=side_effects.default_verbose(self.is_chief) if verbose is None else verbose,
                                 class_weight=class_weight, initial_epoch=initial_epoch,
                                 validation_freq=validation_freq)
        except Exception as exc:
            from stratkit.strategy.compression import overflow_error

            refused = overflow_error(exc)  # gradient_compression="fp16" refused a step: say so plainly
            if refused is None and train.failure is not None:
                refused = _reader_failure(exc, train.failure())  # a table's file vanished mid-run: said as it is
            if refused is None:
                raise
            raise refused from None
        finally:
            side_effects.remove_dirs(temps)
            if backup is not None:
                backup.release()  # (after an exception Keras skips on_train_end)

    @property
    def _multi_worker(self) -> bool:
        return self.spec.strategy == "multi_worker_mirrored" and self.spec.num_workers > 1

    def _min_over_workers(self, value: int) -> int:
        """MIN of an int over all workers (a collective); identity on one worker."""
        if self.spec.strategy != "multi_worker_mirrored" or self.spec.num_workers <= 1:
            return value
        from stratkit.strategy.collectives import min_over_workers

        return min_over_workers(self.strategy, value)

    # -- evaluate / predict ----------------------------------------------------------
    def evaluate(self, model: Any, data: Any, global_batch_size: int | None = None,
                 per_replica_batch_size: int | None = None, steps: int | None = None, verbose: Any = 0,
                 return_dict: bool = True) -> Any:
        """Evaluate over the whole of `data`, sharded across workers; every worker gets the same result."""
        from stratkit.training.inputs import is_dataset_fn, prepare, resolve_global_batch_size, table as table_rules

        global_batch = resolve_global_batch_size(global_batch_size, per_replica_batch_size, self.num_replicas,
                                                 required=not is_dataset_fn(data), data=data)
        if self._ps:
            # Keras' evaluate refuses ParameterServerStrategy datasets: evaluate in this process instead.
            from stratkit.training.ps import evaluate_locally

            return evaluate_locally(model, data, global_batch_size=global_batch, steps=steps,
                                    strategy=self.strategy)
        prepared = prepare(data, strategy=self.strategy, num_replicas=self.num_replicas,
                           global_batch_size=global_batch, steps_per_epoch=steps, training=False,
                           tpu=self.spec.strategy == "tpu", model=model)   # the model decides a table's columns
        if steps is None and prepared.kind == "table":   # one pass, as many steps on every worker
            steps = prepared.steps_per_epoch
        with table_rules.untraced(model, prepared.kind == "table"):
            return model.evaluate(prepared.dataset, steps=steps, verbose=verbose, return_dict=return_dict)

    def predict(self, model: Any, x: Any, global_batch_size: int | None = None,
                per_replica_batch_size: int | None = None, verbose: Any = 0) -> Any:
        """Predict every row of `x`, in order, on every worker.

        `x`: numpy array(s), or a `tf.data.Dataset` of inputs (unbatched, or
        batched with the global batch; `(x, y)` elements are read as in Keras).
        """
        from stratkit.training.inputs import predict_data, predict_dataset, prepare, resolve_global_batch_size
        from stratkit.training.inputs import table as table_rules

        table_rules.refuse(x, predicting=True)
        global_batch = resolve_global_batch_size(global_batch_size, per_replica_batch_size, self.num_replicas,
                                                 required=True, data=x)
        if self._ps or (self.spec.strategy == "multi_worker_mirrored" and self.spec.num_workers > 1):
            # Keras' distributed predict returns only this worker's shard (padded), and refuses
            # ParameterServerStrategy datasets; inference needs no collective, so run it locally.
            return _predict_locally(model, predict_dataset(x, global_batch))
        prepared = prepare(predict_data(x), strategy=self.strategy,
                           num_replicas=self.num_replicas, global_batch_size=global_batch, training=False,
                           shuffle=False, shard=False, tpu=self.spec.strategy == "tpu")
        return model.predict(prepared.dataset, verbose=verbose)

    # -- save -----------------------------------------------------------------------
    def save(self, model: Any, path: str | os.PathLike[str]) -> str | None:
        """Save `model` (a `.keras` file, or `.weights.h5`) from the chief; atomic; creates parent dirs.

        `path` is a local path or a store URL (``s3://``, ``gs://``, ``az://``/``abfs://``, ``hdfs://``,
        ``file://``; `stratkit.storage`): a URL is checked first (a missing bucket, refused credentials, a
        store that does not answer or a missing extra are a `ConfigError` on every worker before anything
        is written), then the chief saves to a local temporary and uploads it as one object.

        Every worker must call it (reading synchronised variables can need all
        of them); non-chief workers write to a temp dir and remove it. First
        the replica check (`stratkit.check_replicas`): replicas whose copies of
        the model differ raise `ReplicaDivergenceError` and nothing is written.

        Returns:
            The path (or URL) written on the chief, None on other workers.
        """
        from stratkit.training import saving

        return saving.save(model, path, strategy=self.strategy, is_chief=self.is_chief, check=not self._ps,
                           agree=self._min_over_workers)


#: Said once on a resume of a shuffled tf.data.Dataset: tf.data's reshuffle restarts its sequence in a new process
#: (numpy arrays' order is a function of the epoch, so it is continued).
_RESHUFFLED = ("shuffle=True on a tf.data.Dataset: the epochs after this resume are shuffled in the order of a run's "
               "first epochs (tf.data starts its reshuffle sequence again in a new process), so the run is as good "
               "as an uninterrupted one but not the same, example for example. Fix: for an exact continuation, pass "
               "numpy arrays (their order is continued), or shuffle the dataset once yourself and pass shuffle=False")


def _reader_failure(exc: BaseException, failure: BaseException | None) -> BaseException | None:
    """The table reader's own error behind the one TensorFlow's input pipeline raised (None: not the reader's)."""
    if failure is None or type(failure).__name__ not in str(exc) and str(failure)[:60] not in str(exc):
        return None
    return failure


def _predict_locally(model: Any, dataset: Any) -> Any:
    """`model` over every batch of `dataset` in this process, outputs concatenated in order."""
    import numpy as np
    import tensorflow as tf

    forward = tf.function(lambda batch: model(batch, training=False), reduce_retracing=True)
    outputs = [forward(batch) for batch in dataset]
    return tf.nest.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs)


def _check_not_legacy_keras(model: Any) -> None:
    """Refuse a tf_keras (legacy Keras 2) model with a message about Keras versions.

    Decision: refuse rather than support. `Trainer` drives Keras 3 models (its
    callbacks, backup and PS loop are Keras 3 code); a tf_keras model needs
    none of stratkit's Keras 3 fixes and already trains correctly under
    `make_strategy()` with its own `fit` (measured on 2 workers: weights equal to 6e-8).
    """
    import sys

    tf_keras = sys.modules.get("tf_keras")  # never import it: only a model made with it can be one
    if tf_keras is not None and isinstance(model, tf_keras.Model):
        raise ConfigError(
            f"build_and_compile returned a tf_keras (legacy Keras 2) {type(model).__name__}, but stratkit.Trainer "
            "trains Keras 3 models (import keras). A tf_keras model needs none of stratkit's Keras 3 fixes. Fix: "
            "build it with Keras 3 (import keras instead of tf_keras), or keep tf_keras and train it yourself: "
            "strategy = stratkit.make_strategy(); build and compile the model inside strategy.scope(); then call "
            "model.fit(...)")
