"""`dataset_fn(input_context)`: the user builds each input pipeline's dataset, batched per replica."""

from __future__ import annotations

from typing import Any, Callable

from stratkit.errors import ConfigError
from stratkit.training.inputs import rules
from stratkit.training.inputs.base import InputAdapter, PreparedData, WorkerContext


def repeating(dataset_fn: rules.DatasetFn) -> rules.DatasetFn:
    """`dataset_fn` whose dataset repeats forever (the steps rule), checked to be a dataset."""
    def repeated(input_context: Any) -> Any:
        dataset = dataset_fn(input_context)
        if not rules.is_dataset(dataset):
            raise ConfigError(f"the dataset_fn passed as data returned {type(dataset).__name__}, not a "
                              "tf.data.Dataset. Fix: return a dataset batched with "
                              "input_context.get_per_replica_batch_size(global_batch_size)")
        return dataset.repeat()  # an infinite dataset stays as it was

    return repeated


class DatasetFnAdapter(InputAdapter):
    kind = "dataset_fn"

    # -- synchronous strategies ------------------------------------------------------------------
    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        if steps_per_epoch is None and training:
            raise ConfigError("steps_per_epoch is required with a dataset_fn(input_context) (its length is not "
                              "known). Fix: pass steps_per_epoch=N, e.g. examples // global_batch_size")
        repeat = training and steps_per_epoch is not None
        dataset = strategy.distribute_datasets_from_function(repeating(self.data) if repeat else self.data)
        return PreparedData(dataset, global_batch_size, steps_per_epoch, None, self.kind,
                            replay=rules.replayed(first_epoch, first_step, steps_per_epoch if repeat else None))

    # -- this process only -----------------------------------------------------------------------
    def local(self, global_batch_size: int | None, what: str) -> Any:
        import tensorflow as tf

        return self.data(tf.distribute.InputContext())  # one pipeline, one replica: the whole dataset

    # -- parameter servers -----------------------------------------------------------------------
    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        import tensorflow as tf

        context = tf.distribute.InputContext(num_input_pipelines=num_workers, input_pipeline_id=0,
                                             num_replicas_in_sync=num_replicas)
        return rules.batched_element_spec(self.data(context).element_spec, batched=True)

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        repeated = repeating(self.data)
        return lambda _: repeated(context())
