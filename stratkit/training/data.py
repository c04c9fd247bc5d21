"""Turn what the user passes as `data` into a dataset the strategy shards correctly.

Three input kinds, each handled in one place:
  * `(x, y)` / `(x, y, sample_weight)` numpy arrays (or `x` alone for predict),
  * an unbatched `tf.data.Dataset`,
  * `dataset_fn(input_context)` returning a per-replica-batched dataset.

Sharding rule: the dataset is batched with the GLOBAL batch and auto-sharded
with DATA, so each global batch is split across the workers: every example is
seen exactly once per epoch across the cluster, never dropped or duplicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from stratkit.errors import ConfigError

DEFAULT_SEED = 20170601  # the same on every worker: DATA sharding needs one shuffle order everywhere


@dataclass
class PreparedData:
    """A dataset ready for `model.fit`/`evaluate`/`predict` under the strategy."""

    dataset: Any
    global_batch_size: int | None
    steps_per_epoch: int | None
    num_examples: int | None
    kind: str  # "numpy", "dataset" or "dataset_fn"


def resolve_global_batch_size(global_batch_size: int | None, per_replica_batch_size: int | None,
                              num_replicas: int, *, required: bool) -> int | None:
    """Exactly one of the two sizes; global = per_replica x num_replicas."""
    for name, value in (("global_batch_size", global_batch_size), ("per_replica_batch_size", per_replica_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer: got {value!r}. Fix: e.g. {name}=64")
    if global_batch_size is not None and per_replica_batch_size is not None:
        if global_batch_size != per_replica_batch_size * num_replicas:
            raise ConfigError(
                f"global_batch_size={global_batch_size} and per_replica_batch_size={per_replica_batch_size} "
                f"disagree with {num_replicas} replica(s) (global = per_replica x replicas = "
                f"{per_replica_batch_size * num_replicas}). Fix: give exactly one of them")
        return global_batch_size
    if per_replica_batch_size is not None:
        return per_replica_batch_size * num_replicas
    if global_batch_size is None and required:
        raise ConfigError("neither global_batch_size nor per_replica_batch_size was given. Fix: give exactly one, "
                          f"e.g. per_replica_batch_size=32 (the global batch is then 32 x {num_replicas} replica(s))")
    return global_batch_size


def _is_dataset(obj: Any) -> bool:
    import tensorflow as tf

    return isinstance(obj, tf.data.Dataset)


def _looks_batched(dataset: Any) -> int | None:
    """The batch size if the dataset's last transformation is a batch, else None."""
    name = type(dataset).__name__
    if "Batch" in name and "Unbatch" not in name and "Rebatch" not in name:
        size = getattr(dataset, "_batch_size", None)
        try:
            return int(size)
        except (TypeError, ValueError):
            return -1
    return None


def _shard_by_data(dataset: Any, policy: str = "DATA") -> Any:
    import tensorflow as tf

    options = tf.data.Options()
    current = dataset.options().experimental_distribute.auto_shard_policy
    if current != tf.data.experimental.AutoShardPolicy.AUTO:
        return dataset  # the user chose a policy on purpose (e.g. FILE over many files)
    options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
    return dataset.with_options(options)


def _numpy_arrays(data: Any) -> tuple:
    import numpy as np

    arrays = data if isinstance(data, (tuple, list)) else (data,)
    if not 1 <= len(arrays) <= 3:
        raise ConfigError(f"data as a tuple must be (x,), (x, y) or (x, y, sample_weight): got {len(arrays)} items. "
                          "Fix: pass (x, y) numpy arrays, a tf.data.Dataset or a dataset_fn(input_context)")
    lengths = set()
    for i, part in enumerate(arrays):
        leaves = list(part.values()) if isinstance(part, dict) else [part]
        for leaf in leaves:
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise ConfigError(f"data[{i}] is a {type(leaf).__name__}, not an array. Fix: pass numpy arrays "
                                  "(np.asarray(...)), a tf.data.Dataset or a dataset_fn(input_context)")
            lengths.add(int(np.shape(leaf)[0]))
    if len(lengths) != 1:
        raise ConfigError(f"data arrays have different numbers of rows: {sorted(lengths)}. "
                          "Fix: x, y (and sample_weight) must have one row per example")
    return tuple(arrays)


def prepare(data: Any, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
            steps_per_epoch: int | None = None, training: bool = True, shuffle: bool = True,
            seed: int = DEFAULT_SEED, tpu: bool = False, drop_remainder: bool = False,
            shard: bool = True) -> PreparedData:
    """Build the dataset for one of fit/evaluate/predict.

    Args:
        data: numpy tuple, unbatched tf.data.Dataset or dataset_fn(input_context).
        strategy: the tf.distribute strategy (used for dataset_fn).
        num_replicas: replicas in sync (for checks).
        global_batch_size: the global batch (None only for dataset_fn).
        steps_per_epoch: given by the user (required for dataset_fn).
        training: shuffle numpy inputs each epoch (same seed everywhere).
        tpu: enforce what TPUs need (static shapes, drop_remainder, divisible batch).
        shard: False gives every worker the whole dataset (predict returns all rows everywhere).
    """
    import tensorflow as tf

    if callable(data) and not _is_dataset(data):
        if steps_per_epoch is None and training:
            raise ConfigError("steps_per_epoch is required with a dataset_fn(input_context) (its length is not "
                              "known). Fix: pass steps_per_epoch=N, e.g. examples // global_batch_size")
        dataset = strategy.distribute_datasets_from_function(data)
        return PreparedData(dataset, global_batch_size, steps_per_epoch, None, "dataset_fn")

    if global_batch_size is None:
        raise ConfigError("neither global_batch_size nor per_replica_batch_size was given. Fix: give exactly one, "
                          f"e.g. per_replica_batch_size=32 (the global batch is then 32 x {num_replicas} replica(s))")
    _check_divisible(global_batch_size, num_replicas, tpu)
    drop = drop_remainder or tpu

    if _is_dataset(data):
        batched = _looks_batched(data)
        if batched is not None:
            raise ConfigError(f"data is a tf.data.Dataset that is already batched (batch size {batched}). "
                              f"Fix: pass it unbatched (stratkit batches with the global batch "
                              f"{global_batch_size} and shards it), or pass dataset_fn(input_context) "
                              "returning a per-replica-batched dataset")
        dataset = data
        cardinality = int(data.cardinality())
        num_examples = cardinality if cardinality >= 0 else None
        if tpu:
            _check_static_shapes(data.element_spec)
    else:
        arrays = _numpy_arrays(data)
        num_examples = int(len(next(iter(arrays[0].values())) if isinstance(arrays[0], dict) else arrays[0]))
        dataset = tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])
        if training and shuffle:
            dataset = dataset.shuffle(num_examples, seed=seed, reshuffle_each_iteration=True)

    if num_examples is not None and num_examples < global_batch_size and (training or drop):
        raise ConfigError(f"global_batch_size={global_batch_size} is larger than the {num_examples} examples in "
                          f"data. Fix: use a global batch of at most {num_examples} "
                          f"(per replica at most {num_examples // max(num_replicas, 1)})")
    if num_examples is not None and num_replicas > 1 and 0 < num_examples < global_batch_size \
            and num_examples % num_replicas:
        # Keras builds the model from the first batch; an uneven one fails in AddN on several replicas.
        raise ConfigError(f"data has {num_examples} examples, fewer than global_batch_size={global_batch_size}, "
                          f"so its only batch does not split evenly over {num_replicas} replicas. Fix: pass a "
                          f"multiple of {num_replicas} examples (e.g. {num_examples - num_examples % num_replicas})")
    dataset = dataset.batch(global_batch_size, drop_remainder=drop)
    dataset = _shard_by_data(dataset, "DATA" if shard else "OFF")
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    steps = steps_per_epoch
    if steps is None and num_examples is not None:
        steps = num_examples // global_batch_size if drop else math.ceil(num_examples / global_batch_size)
    return PreparedData(dataset, global_batch_size, steps, num_examples, "dataset" if _is_dataset(data) else "numpy")


def _check_divisible(global_batch_size: int, num_replicas: int, tpu: bool) -> None:
    if num_replicas > 1 and global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not split evenly over {num_replicas} replicas "
            f"({'TPU cores need equal shards' if tpu else 'Keras 3 fails on an uneven first batch: AddN must have the same size and shape'}). "
            f"Fix: use a multiple of {num_replicas}, e.g. {max(lower, num_replicas)} or {lower + num_replicas}, "
            "or pass per_replica_batch_size")


def _check_static_shapes(element_spec: Any) -> None:
    import tensorflow as tf

    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and not shape.is_fully_defined():
            raise ConfigError(f"TPU needs static shapes, but the dataset has an element of shape {shape}. "
                              "Fix: pad or resize to a fixed shape before batching (e.g. padded_batch or "
                              "tf.image.resize), so XLA can compile one program")


DatasetFn = Callable[[Any], Any]
