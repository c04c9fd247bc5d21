"""Turn what the user passes as `data` into a dataset the strategy shards correctly.

Four input kinds, each handled in one place:
  * `(x, y)` / `(x, y, sample_weight)` numpy arrays (or `x` alone for predict),
  * an unbatched `tf.data.Dataset` (stratkit batches it with the global batch),
  * a `tf.data.Dataset` already batched with the global batch (`ds.batch(64)`,
    also followed by `prefetch`, `map`, `cache`, ...), used as it is; its batch
    size is the global batch when none is given, and any other size is refused,
  * `dataset_fn(input_context)` returning a per-replica-batched dataset.

Sharding rule: the dataset is batched with the GLOBAL batch and auto-sharded
with DATA, so each global batch is split across the workers: every example is
seen exactly once per epoch across the cluster, never dropped or duplicated.

Steps rule (every input kind, every strategy, parameter servers included):
`steps_per_epoch=N` runs exactly N steps every epoch. Finite training data is
read as one stream, repeated as often as needed (numpy arrays reshuffled on
each pass), and each epoch continues where the previous one stopped, as Keras
does with a `.repeat()`ed dataset. Without `steps_per_epoch` an epoch is one
pass over the data. (Keras itself cuts an epoch short with only a warning,
"Your input ran out of data", when finite data has fewer batches than asked.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from stratkit.errors import ConfigError

DEFAULT_SEED = 20170601  # the same on every worker: DATA sharding needs one shuffle order everywhere

DatasetFn = Callable[[Any], Any]


@dataclass
class PreparedData:
    """A dataset ready for `model.fit`/`evaluate`/`predict` under the strategy."""

    dataset: Any
    global_batch_size: int | None
    steps_per_epoch: int | None
    num_examples: int | None
    kind: str  # "numpy", "dataset", "batched_dataset" or "dataset_fn"


def resolve_global_batch_size(global_batch_size: int | None, per_replica_batch_size: int | None,
                              num_replicas: int, *, required: bool, data: Any = None) -> int | None:
    """Exactly one of the two sizes; global = per_replica x num_replicas.

    With `data` already batched (a `tf.data.Dataset` batched with B): no size
    given means the global batch is B; a size given must be B.
    """
    batched = batch_size_of(data)
    if batched is None:
        return _resolve_sizes(global_batch_size, per_replica_batch_size, num_replicas, required=required)
    resolved = _resolve_sizes(global_batch_size, per_replica_batch_size, num_replicas, required=False)
    if resolved is None:
        if batched < 1:
            raise _unreadable_batch()
        return batched
    check_batched(batched, resolved)
    return resolved


def _resolve_sizes(global_batch_size: int | None, per_replica_batch_size: int | None, num_replicas: int, *,
                   required: bool) -> int | None:
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


def batch_size_of(data: Any) -> int | None:
    """The batch size of `data` if it is an already-batched `tf.data.Dataset` (-1: size unknown), else None."""
    if data is None or isinstance(data, (tuple, list, dict)) or not _is_dataset(data):
        return None  # the cheap cases first: no TensorFlow import for them
    from stratkit.strategy import keras_compat

    return keras_compat.dataset_batch_size(data)


def _unreadable_batch() -> ConfigError:
    return ConfigError("data is a tf.data.Dataset that is already batched, with a batch size stratkit cannot read. "
                       "Fix: pass global_batch_size=<its batch size>")


def check_batched(batched: int, global_batch_size: int | None) -> None:
    """A batched dataset is used as it is: its batch must be the global batch."""
    if batched > 0 and global_batch_size is not None and batched != global_batch_size:
        raise ConfigError(
            f"data is a tf.data.Dataset that is already batched (batch size {batched}), but the global batch is "
            f"global_batch_size={global_batch_size} (examples per step over all replicas). Fix: batch it with "
            f"{global_batch_size} (the global batch, not the per-replica one), or pass it unbatched (stratkit "
            f"batches and shards it), or give no batch size to train with its own batch of {batched}")


def _repeating_fn(dataset_fn: DatasetFn) -> DatasetFn:
    def repeating(input_context: Any) -> Any:
        dataset = dataset_fn(input_context)
        if not _is_dataset(dataset):
            raise ConfigError(f"the dataset_fn passed as data returned {type(dataset).__name__}, not a "
                              "tf.data.Dataset. Fix: return a dataset batched with "
                              "input_context.get_per_replica_batch_size(global_batch_size)")
        return dataset.repeat()  # an infinite dataset stays as it was

    return repeating


def local_batches(data: Any, global_batch_size: int | None, what: str = "data") -> Any:
    """`data` as one local, finite, batched dataset: no sharding, no shuffling, no repeat.

    For evaluation and prediction in this process (parameter-server chief and
    evaluator, predict on several workers). numpy arrays and unbatched datasets
    are batched with `global_batch_size`; a batched dataset is used as it is.
    """
    import tensorflow as tf

    if _is_dataset(data):
        batched = batch_size_of(data)
        if batched is not None:
            check_batched(batched, global_batch_size)
            return data
        dataset = data
    else:
        arrays = _numpy_arrays(data)
        dataset = tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])
    if global_batch_size is None:
        raise ConfigError(f"{what} needs a batch size. Fix: pass global_batch_size=N or per_replica_batch_size=N")
    return dataset.batch(int(global_batch_size))


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
        data: numpy tuple, tf.data.Dataset (unbatched, or batched with the global batch) or
            dataset_fn(input_context).
        strategy: the tf.distribute strategy (used for dataset_fn).
        num_replicas: replicas in sync (for checks).
        global_batch_size: the global batch (None only for dataset_fn).
        steps_per_epoch: given by the user (required for dataset_fn).
        training: shuffle numpy inputs each epoch (same seed everywhere).
        tpu: enforce what TPUs need (static shapes, drop_remainder, divisible batch).
        shard: False gives every worker the whole dataset (predict returns all rows everywhere).
    """
    import tensorflow as tf

    repeat = training and steps_per_epoch is not None  # the steps rule: every step asked for runs
    if callable(data) and not _is_dataset(data):
        if steps_per_epoch is None and training:
            raise ConfigError("steps_per_epoch is required with a dataset_fn(input_context) (its length is not "
                              "known). Fix: pass steps_per_epoch=N, e.g. examples // global_batch_size")
        dataset = strategy.distribute_datasets_from_function(_repeating_fn(data) if repeat else data)
        return PreparedData(dataset, global_batch_size, steps_per_epoch, None, "dataset_fn")

    batched = batch_size_of(data)
    if batched is not None:
        if global_batch_size is None and batched > 0:
            global_batch_size = batched
        return _prepare_batched(data, batched, num_replicas=num_replicas, global_batch_size=global_batch_size,
                                steps_per_epoch=steps_per_epoch, repeat=repeat, tpu=tpu, shard=shard)

    if global_batch_size is None:
        raise ConfigError("neither global_batch_size nor per_replica_batch_size was given. Fix: give exactly one, "
                          f"e.g. per_replica_batch_size=32 (the global batch is then 32 x {num_replicas} replica(s))")
    _check_divisible(global_batch_size, num_replicas, tpu)
    drop = drop_remainder or tpu

    if _is_dataset(data):
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
            # reshuffle_each_iteration: a new order on each pass, also within one repeated stream.
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
    if repeat:
        dataset = dataset.repeat()  # before batching: batches run on across passes, all full
    dataset = dataset.batch(global_batch_size, drop_remainder=drop)
    dataset = _shard_by_data(dataset, "DATA" if shard else "OFF")
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    steps = steps_per_epoch
    if steps is None and num_examples is not None:
        steps = num_examples // global_batch_size if drop else math.ceil(num_examples / global_batch_size)
    return PreparedData(dataset, global_batch_size, steps, num_examples, "dataset" if _is_dataset(data) else "numpy")


def _prepare_batched(data: Any, batched: int, *, num_replicas: int, global_batch_size: int | None,
                     steps_per_epoch: int | None, repeat: bool, tpu: bool, shard: bool) -> PreparedData:
    """A dataset the user batched with the global batch: repeated if asked, sharded, never re-batched."""
    if global_batch_size is None:
        raise _unreadable_batch()
    check_batched(batched, global_batch_size)
    _check_divisible(global_batch_size, num_replicas, tpu)
    if tpu:
        _check_static_shapes(data.element_spec)  # a batched dataset needs drop_remainder=True for this
    cardinality = int(data.cardinality())
    dataset = data.repeat() if repeat else data
    dataset = _shard_by_data(dataset, "DATA" if shard else "OFF")
    steps = steps_per_epoch if steps_per_epoch is not None else (cardinality if cardinality >= 0 else None)
    return PreparedData(dataset, global_batch_size, steps, None, "batched_dataset")


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

