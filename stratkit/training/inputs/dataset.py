"""An unbatched `tf.data.Dataset`: stratkit batches it with the global batch (and shards it)."""

from __future__ import annotations

import math
from typing import Any, Callable

from stratkit.errors import ConfigError
from stratkit.training.inputs import rules
from stratkit.training.inputs.base import InputAdapter, PreparedData, WorkerContext, per_step_rows


class DatasetAdapter(InputAdapter):
    """A dataset of examples. `ArrayAdapter` is the same, with the examples made from numpy arrays."""

    kind = "dataset"

    def examples(self) -> Any:
        """The dataset of single examples."""
        return self.data

    def num_examples(self) -> int | None:
        cardinality = int(self.data.cardinality())
        return cardinality if cardinality >= 0 else None

    def _check_for_tpu(self) -> None:
        rules.check_static_shapes(self.data.element_spec)

    def _shuffled(self, dataset: Any, *, buffer: int | None, seed: int) -> Any:
        return dataset  # the user's dataset decides its own order

    def _epoch_stream(self, *, global_batch_size: int, steps_per_epoch: int | None, drop: bool, seed: int,
                      first_epoch: int, first_step: int = 0) -> Any:
        """The batches of every epoch from `first_epoch` on, each epoch's order fixed by (seed, epoch); or None.

        None: this input's order is its own (a dataset decides it), so it cannot be keyed by epoch.
        """
        return None

    # -- synchronous strategies ------------------------------------------------------------------
    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        import tensorflow as tf

        if global_batch_size is None:
            raise rules.no_batch_size(num_replicas)
        rules.check_divisible(global_batch_size, num_replicas, tpu)
        drop = drop_remainder or tpu
        if tpu:
            self._check_for_tpu()
        num_examples = self.num_examples()
        dataset = self.examples()
        stream = None
        if training and shuffle:
            stream = self._epoch_stream(global_batch_size=global_batch_size, steps_per_epoch=steps_per_epoch,
                                        drop=drop, seed=seed, first_epoch=first_epoch, first_step=first_step)
            dataset = self._shuffled(dataset, buffer=num_examples, seed=seed)
        if num_examples is not None and num_examples < global_batch_size and (training or drop):
            raise ConfigError(f"global_batch_size={global_batch_size} is larger than the {num_examples} examples in "
                              f"data. Fix: use a global batch of at most {num_examples} "
                              f"(per replica at most {num_examples // max(num_replicas, 1)})")
        if num_examples is not None and num_replicas > 1 and 0 < num_examples < global_batch_size \
                and num_examples % num_replicas:
            # Keras builds the model from the first batch; an uneven one fails in AddN on several replicas.
            raise ConfigError(f"data has {num_examples} examples, fewer than global_batch_size={global_batch_size}, "
                              f"so its only batch does not split evenly over {num_replicas} replicas. Fix: pass a "
                              f"multiple of {num_replicas} examples "
                              f"(e.g. {num_examples - num_examples % num_replicas})")
        if stream is not None:
            dataset = stream  # endless: fit must be given the steps (PreparedData.endless)
        else:
            if training and steps_per_epoch is not None:  # the steps rule: every step asked for runs
                dataset = dataset.repeat()  # before batching: batches run on across passes, all full
            dataset = dataset.batch(global_batch_size, drop_remainder=drop)
        dataset = rules.shard_by(dataset, "DATA" if shard else "OFF", strategy)
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
        steps = steps_per_epoch
        if steps is None and num_examples is not None:
            steps = num_examples // global_batch_size if drop else math.ceil(num_examples / global_batch_size)
        replay = 0 if stream is not None or not training else rules.replayed(first_epoch, first_step, steps_per_epoch)
        return PreparedData(dataset, global_batch_size, steps, num_examples, self.kind, endless=stream is not None,
                            replay=replay)

    # -- this process only -----------------------------------------------------------------------
    def local(self, global_batch_size: int | None, what: str) -> Any:
        dataset = self.examples()
        return dataset.batch(rules.need_batch(global_batch_size, what))

    # -- parameter servers -----------------------------------------------------------------------
    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        return rules.batched_element_spec(self.examples().element_spec, batched=False)

    def check_worker_shards(self, global_batch_size: int | None, num_workers: int, num_replicas: int) -> None:
        if global_batch_size is None or num_workers < 1:
            return
        size = self.num_examples()
        if size is not None:  # infinite or unknown: nothing to check here
            per_step_rows(size, global_batch_size, num_workers, num_replicas)

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        import tensorflow as tf

        global_batch = rules.need_batch(global_batch_size, "data given as arrays or a tf.data.Dataset",
                                        "global_batch_size=N (examples per step) or per_replica_batch_size=N to "
                                        "trainer.fit")
        rebuild = serialized(self.examples())
        shuffled = self._shuffled

        def from_data(_: Any) -> Any:
            ctx = context()
            dataset = rebuild().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            # Each worker shuffles its own shard (numpy arrays; a dataset keeps its order), reshuffled
            # each pass. The seed is a Python int: a tensor seed (e.g. seed + the worker's index) crashes
            # TF's get_seed when the global seed is 0, as after keras.utils.set_random_seed(0).
            dataset = shuffled(dataset, buffer=4096, seed=seed)
            batch = ctx.get_per_replica_batch_size(global_batch)
            return dataset.repeat().batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

        return from_data


def serialized(dataset: Any) -> Callable[[], Any]:
    """A function that rebuilds `dataset` from its graph, wherever it runs.

    A dataset made on the chief lives in the chief's memory; a function run on
    a worker cannot read it, but it can rebuild it from its graph.
    """
    import tensorflow as tf

    from stratkit.strategy import keras_ps

    graph, spec = keras_ps.dataset_graph(dataset), dataset.element_spec
    return lambda: tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)
