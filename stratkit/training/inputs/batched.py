"""A `tf.data.Dataset` the user already batched with the global batch (`ds.batch(64).prefetch(...)`).

Used as it is: never re-batched for a synchronous strategy, sharded by whole
batches. Its batch is the global batch when none is given; any other size is
refused (`rules.check_batched`).
"""

from __future__ import annotations

from typing import Any, Callable

from stratkit.errors import ConfigError
from stratkit.training.inputs import rules
from stratkit.training.inputs.base import InputAdapter, PreparedData, WorkerContext
from stratkit.training.inputs.dataset import serialized


class BatchedDatasetAdapter(InputAdapter):
    kind = "batched_dataset"

    def __init__(self, data: Any, batch_size: int) -> None:
        super().__init__(data)
        self.batch_size = batch_size  # -1: batched, size unknown

    # -- synchronous strategies ------------------------------------------------------------------
    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        """Repeated if asked, sharded, never re-batched; a mid-epoch resume replays what was read before."""
        if global_batch_size is None and self.batch_size > 0:
            global_batch_size = self.batch_size
        if global_batch_size is None:
            raise rules.unreadable_batch()
        rules.check_batched(self.batch_size, global_batch_size)
        rules.check_divisible(global_batch_size, num_replicas, tpu)
        if tpu:
            rules.check_static_shapes(self.data.element_spec)  # a batched dataset needs drop_remainder=True for this
        cardinality = int(self.data.cardinality())
        stream = training and steps_per_epoch is not None
        dataset = self.data.repeat() if stream else self.data
        dataset = rules.shard_by(dataset, "DATA" if shard else "OFF", strategy)
        steps = steps_per_epoch if steps_per_epoch is not None else (cardinality if cardinality >= 0 else None)
        return PreparedData(dataset, global_batch_size, steps, None, self.kind,
                            replay=rules.replayed(first_epoch, first_step, steps_per_epoch if stream else None))

    # -- this process only -----------------------------------------------------------------------
    def local(self, global_batch_size: int | None, what: str) -> Any:
        rules.check_batched(self.batch_size, global_batch_size)
        return self.data

    # -- parameter servers -----------------------------------------------------------------------
    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        return rules.batched_element_spec(self.data.element_spec, batched=True)

    def check_worker_shards(self, global_batch_size: int | None, num_workers: int, num_replicas: int) -> None:
        if global_batch_size is None or num_workers < 1:
            return
        size = int(self.data.cardinality())
        if 0 <= size < num_workers:
            raise ConfigError(f"data has {size} batch(es), fewer than the {num_workers} workers that each read "
                              "their own share of the batches: a worker would have none. Fix: pass more data, or "
                              "pass it unbatched (stratkit then shards examples, not batches)")

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        import tensorflow as tf

        global_batch = rules.need_batch(global_batch_size, "data given as arrays or a tf.data.Dataset",
                                        "global_batch_size=N (examples per step) or per_replica_batch_size=N to "
                                        "trainer.fit")
        rebuild = serialized(self.data)

        def from_data(_: Any) -> Any:
            ctx = context()
            dataset = rebuild().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)  # whole batches
            batch = ctx.get_per_replica_batch_size(global_batch)
            # One batch is one step; split it only when a worker has several replicas (rebatch, not
            # unbatch + batch).
            dataset = dataset.repeat() if batch == global_batch else dataset.repeat().rebatch(batch)
            return dataset.prefetch(tf.data.AUTOTUNE)

        return from_data
