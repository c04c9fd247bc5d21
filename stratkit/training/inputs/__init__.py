"""One input layer: what the user passes as `data`, turned into what each kind of run needs.

Five input kinds, one adapter each (chosen once by `adapter_for`, as Keras'
`trainers/data_adapters/`):
  * `(x, y)` / `(x, y, sample_weight)` numpy arrays (or `x` alone for predict):
    `arrays.ArrayAdapter`;
  * an unbatched `tf.data.Dataset` (stratkit batches it with the global batch):
    `dataset.DatasetAdapter`;
  * a `tf.data.Dataset` already batched with the global batch (`ds.batch(64)`,
    also followed by `prefetch`, `map`, `cache`, ...), used as it is; its batch
    size is the global batch when none is given, and any other size is refused:
    `batched.BatchedDatasetAdapter`;
  * `dataset_fn(input_context)` returning a per-replica-batched dataset:
    `dataset_fn.DatasetFnAdapter`;
  * a `keras.utils.PyDataset` (its batch is the global batch), handed to
    Keras's own PyDataset adapter: `py_dataset.PyDatasetAdapter`;
  * a `stratkit.data.TableInput` (a Parquet, Delta or TFRecord table), read
    per worker in one order at any world size: `table.TableAdapter`.

A Python generator is refused (`rules.generator_refusal` says why and what to
pass instead).

Every caller goes through an adapter: `Trainer.fit`/`evaluate`/`predict` on
the synchronous strategies (`prepare`), evaluation and prediction in this
process (`local_dataset`, `predict_dataset`), and the parameter-server loop
(`InputAdapter.worker_dataset_fn`, `check_worker_shards`,
`batched_element_spec`). The checks every kind shares live in `rules`.

Sharding rule: the dataset is batched with the GLOBAL batch and auto-sharded
with DATA, so each global batch is split across the workers: every example is
seen exactly once per epoch across the cluster, never dropped or duplicated.
On parameter servers each worker reads its own shard (examples, or whole
batches of a batched dataset), repeated forever.

Steps rule (every input kind, every strategy, parameter servers included):
`steps_per_epoch=N` runs exactly N steps every epoch. Finite training data is
read as one stream, repeated as often as needed (numpy arrays reshuffled on
each pass), and each epoch continues where the previous one stopped, as Keras
does with a `.repeat()`ed dataset. Without `steps_per_epoch` an epoch is one
pass over the data. (Keras itself cuts an epoch short with only a warning,
"Your input ran out of data", when finite data has fewer batches than asked.)
"""

from __future__ import annotations

from typing import Any

from stratkit.errors import ConfigError
from stratkit.training.inputs.arrays import ArrayAdapter
from stratkit.training.inputs.base import InputAdapter, PreparedData
from stratkit.training.inputs.batched import BatchedDatasetAdapter
from stratkit.training.inputs.dataset import DatasetAdapter
from stratkit.training.inputs.dataset_fn import DatasetFnAdapter
from stratkit.training.inputs.py_dataset import PyDatasetAdapter
from stratkit.training.inputs.rules import (DEFAULT_SEED, batch_size_of, batched_element_spec, check_batched,
                                            check_divisible, generator_refusal, is_dataset, is_dataset_fn,
                                            is_generator, is_py_dataset, resolve_global_batch_size)

__all__ = ["DEFAULT_SEED", "InputAdapter", "PreparedData", "adapter_for", "batch_size_of", "batched_element_spec",
           "check_batched", "check_divisible", "is_dataset", "is_dataset_fn", "is_py_dataset", "local_dataset",
           "predict_data", "predict_dataset", "prepare", "resolve_global_batch_size"]


def adapter_for(data: Any, model: Any = None) -> InputAdapter:
    """The adapter for `data`'s kind (a dataset's batch size is read once, here; `model` decides a table's
    columns' dtypes and structure)."""
    from stratkit.data import TableInput

    if isinstance(data, TableInput):
        from stratkit.training.inputs.table import TableAdapter

        return TableAdapter(data, model)
    if is_dataset(data):
        batched = batch_size_of(data)
        return DatasetAdapter(data) if batched is None else BatchedDatasetAdapter(data, batched)
    if is_dataset_fn(data):
        return DatasetFnAdapter(data)
    if is_py_dataset(data):
        return PyDatasetAdapter(data)
    if is_generator(data):
        raise generator_refusal()
    return ArrayAdapter(data)


def prepare(data: Any, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
            steps_per_epoch: int | None = None, training: bool = True, shuffle: bool = True,
            seed: int = DEFAULT_SEED, tpu: bool = False, drop_remainder: bool = False,
            shard: bool = True, first_epoch: int = 0, first_step: int = 0, model: Any = None) -> PreparedData:
    """Build the dataset for one of fit/evaluate/predict under a synchronous strategy.

    Args:
        data: numpy tuple, tf.data.Dataset (unbatched, or batched with the global batch) or
            dataset_fn(input_context).
        strategy: the tf.distribute strategy (used for dataset_fn).
        num_replicas: replicas in sync (for checks).
        global_batch_size: the global batch (None only for dataset_fn or a batched dataset).
        steps_per_epoch: given by the user (required for dataset_fn).
        training: shuffle numpy inputs each epoch (same seed everywhere).
        tpu: enforce what TPUs need (static shapes, drop_remainder, divisible batch).
        shard: False gives every worker the whole dataset (predict returns all rows everywhere).
        first_epoch: the epoch training starts at (a resume): shuffled numpy arrays give each epoch the
            order an uninterrupted run gives it.
        first_step: the step of `first_epoch` training starts at (a mid-epoch resume): the input starts at
            that batch (`PreparedData.replay`: the batches the first epoch must still read and drop).
        model: the model being trained (a `TableInput` feeds its inputs in their dtypes and structure).
    """
    return adapter_for(data, model).distribute(strategy=strategy, num_replicas=num_replicas,
                                        global_batch_size=global_batch_size, steps_per_epoch=steps_per_epoch,
                                        training=training, shuffle=shuffle, seed=seed, tpu=tpu,
                                        drop_remainder=drop_remainder, shard=shard, first_epoch=first_epoch,
                                        first_step=first_step)


def local_dataset(data: Any, global_batch_size: int | None, steps: int | None = None, *,
                  what: str = "validation_data as arrays or a tf.data.Dataset") -> Any:
    """`data` as one local, finite, batched dataset, read once in this process (or `steps` batches).

    For evaluation without the strategy's input pipeline (the parameter-server
    chief and evaluator). numpy arrays and unbatched datasets are batched with
    `global_batch_size`; a batched dataset is used as it is; a dataset_fn is
    called with a one-pipeline context.
    """
    import tensorflow as tf

    dataset = adapter_for(data).local(global_batch_size, what)
    if steps is not None:
        dataset = dataset.take(int(steps))
    elif int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ConfigError("validation_data is an infinite dataset and validation_steps=None. Fix: pass "
                          "validation_steps=N, or make the validation dataset finite")
    return dataset.prefetch(tf.data.AUTOTUNE)


def predict_data(x: Any) -> Any:
    """What `predict`'s `x` is as data: a dataset or a tuple as given, anything else as `(x,)`."""
    return x if isinstance(x, tuple) or is_dataset(x) else (x,)


def predict_dataset(x: Any, batch_size: int) -> Any:
    """Local batches of the model's inputs in `x`, in order (predict in this process)."""
    return adapter_for(predict_data(x)).predict_inputs(batch_size)
