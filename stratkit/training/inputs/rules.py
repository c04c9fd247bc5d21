"""The input rules every input kind shares: batch sizes, divisibility, an already-batched dataset's batch.

One place for each check, so `fit`, `evaluate`, `predict` and the
parameter-server loop refuse the same inputs with the same words.
"""

from __future__ import annotations

from typing import Any, Callable

from stratkit.errors import ConfigError

DEFAULT_SEED = 20170601  # the same on every worker: DATA sharding needs one shuffle order everywhere

DatasetFn = Callable[[Any], Any]


def is_dataset(obj: Any) -> bool:
    """True for a `tf.data.Dataset` (imports TensorFlow only for objects that might be one)."""
    if obj is None or isinstance(obj, (tuple, list, dict)) or hasattr(obj, "__array__"):
        return False  # the cheap cases first: no TensorFlow import for them
    import tensorflow as tf

    return isinstance(obj, tf.data.Dataset)


def is_py_dataset(obj: Any) -> bool:
    """True for a `keras.utils.PyDataset` (imports Keras only for objects that might be one)."""
    if obj is None or isinstance(obj, (tuple, list, dict)) or hasattr(obj, "__array__") \
            or not hasattr(obj, "__getitem__"):
        return False
    import keras

    return isinstance(obj, keras.utils.PyDataset)


def is_generator(obj: Any) -> bool:
    """True for a Python generator object (what Keras's `fit` reads with its generator adapter)."""
    import types

    return isinstance(obj, types.GeneratorType)


def generator_refusal() -> ConfigError:
    return ConfigError(
        "data is a Python generator: it can be read only once, so Trainer.fit can neither run steps_per_epoch steps "
        "every epoch (the steps rule repeats finite data) nor read its batch size without losing a batch, and its "
        "second epoch would get only what the first left. Fix: wrap the batches in a keras.utils.PyDataset "
        "(__len__ and __getitem__; stratkit.Trainer takes it as it is), or pass "
        "tf.data.Dataset.from_generator(<the generator function>, output_signature=...) (the function, not a "
        "generator: every pass restarts it), or numpy arrays")


def py_dataset_batch(data: Any) -> int:
    """The rows in batch 0 of PyDataset `data` (read once: Keras reads it too, to learn the shapes)."""
    import tensorflow as tf

    first = data[0]
    leaves = tf.nest.flatten(first)
    if not leaves or not hasattr(leaves[0], "shape") or not len(leaves[0].shape):
        raise ConfigError(f"the PyDataset's batch 0 is {type(first).__name__}, not batches of arrays. Fix: return "
                          "(x, y) or (x, y, sample_weight) batches of arrays from __getitem__")
    return int(leaves[0].shape[0])


def check_py_dataset_batch(batch: int, global_batch_size: int | None) -> None:
    """A PyDataset carries its own batching: its batch is the global batch."""
    if global_batch_size is not None and batch != global_batch_size:
        raise ConfigError(f"data is a keras.utils.PyDataset: it carries its own batching, and its batch of {batch} "
                          f"rows is the global batch, but global_batch_size={global_batch_size} (or "
                          "per_replica_batch_size x replicas) was given. Fix: drop global_batch_size / "
                          f"per_replica_batch_size (the global batch is then {batch}), or make the PyDataset's "
                          f"batches {global_batch_size} rows")


def is_dataset_fn(data: Any) -> bool:
    """True for a `dataset_fn(input_context)` (any callable that is not a dataset or a container)."""
    return callable(data) and not isinstance(data, (tuple, list, dict)) and not is_dataset(data)


def batch_size_of(data: Any) -> int | None:
    """The batch size of `data` if it is an already-batched `tf.data.Dataset` (-1: size unknown), else None."""
    if not is_dataset(data):
        return None
    from stratkit.strategy import keras_compat

    return keras_compat.dataset_batch_size(data)


def resolve_global_batch_size(global_batch_size: int | None, per_replica_batch_size: int | None,
                              num_replicas: int, *, required: bool, data: Any = None) -> int | None:
    """Exactly one of the two sizes; global = per_replica x num_replicas.

    With `data` already batched (a `tf.data.Dataset` batched with B, or a
    `keras.utils.PyDataset` of B-row batches): no size given means the global
    batch is B; a size given must be B.
    """
    if is_generator(data):
        raise generator_refusal()
    if is_py_dataset(data):
        resolved = _resolve_sizes(global_batch_size, per_replica_batch_size, num_replicas, required=False)
        batch = py_dataset_batch(data)
        check_py_dataset_batch(batch, resolved)
        return batch
    batched = batch_size_of(data)
    if batched is None:
        return _resolve_sizes(global_batch_size, per_replica_batch_size, num_replicas, required=required)
    resolved = _resolve_sizes(global_batch_size, per_replica_batch_size, num_replicas, required=False)
    if resolved is None:
        if batched < 1:
            raise unreadable_batch()
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
        raise no_batch_size(num_replicas)
    return global_batch_size


def no_batch_size(num_replicas: int) -> ConfigError:
    return ConfigError("neither global_batch_size nor per_replica_batch_size was given. Fix: give exactly one, "
                       f"e.g. per_replica_batch_size=32 (the global batch is then 32 x {num_replicas} replica(s))")


def need_batch(global_batch_size: int | None, what: str, fix: str = "global_batch_size=N or "
               "per_replica_batch_size=N") -> int:
    """`global_batch_size` as an int, or a `ConfigError` saying `what` needs one."""
    if global_batch_size is None:
        raise ConfigError(f"{what} needs a batch size. Fix: pass {fix}")
    return int(global_batch_size)


def unreadable_batch() -> ConfigError:
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


def check_divisible(global_batch_size: int, num_replicas: int, tpu: bool = False) -> None:
    """The global batch must split evenly over the replicas (the one place this is checked).

    Keras 3 fails on an uneven first batch with `AddN must have the same size
    and shape`; TPU cores need equal shards. (With the compat patch active the
    AddN crash is gone, but unequal shares would still weigh samples unequally.)
    """
    if num_replicas > 1 and global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        choices = f"{lower} or {lower + num_replicas}" if lower else f"{num_replicas}"
        why = ("TPU cores need equal shards" if tpu else
               "Keras 3 fails on an uneven first batch: AddN must have the same size and shape")
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not split evenly over {num_replicas} replicas ({why}). "
            f"Fix: use a multiple of {num_replicas}, e.g. {choices}, or pass per_replica_batch_size")


def check_static_shapes(element_spec: Any) -> None:
    import tensorflow as tf

    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and not shape.is_fully_defined():
            raise ConfigError(f"TPU needs static shapes, but the dataset has an element of shape {shape}. "
                              "Fix: pad or resize to a fixed shape before batching (e.g. padded_batch or "
                              "tf.image.resize), so XLA can compile one program")


def replayed(first_epoch: int, first_step: int, steps_per_epoch: int | None) -> int:
    """Batches a mid-epoch resume reads and drops from the training iterator `fit` makes (0: none to resume).

    A pipeline stratkit cannot position by index is replayed through the very
    iterator `fit` trains from: one stream for the run (`steps_per_epoch`: every
    batch read before), or one pass per epoch (the epoch's first steps). The
    same iterators are made as in an uninterrupted run, so even a reshuffle
    with a fixed seed (whose seeds every iterator of a dataset draws from, Keras's
    first-batch peek included) gives the same batches. (An epoch backup's resume
    does not use it: there a stream starts afresh, as before step backups.)
    """
    return first_epoch * steps_per_epoch + first_step if steps_per_epoch else first_step


def shard_by(dataset: Any, policy: str = "DATA", strategy: Any = None) -> Any:
    """`dataset` with auto-shard `policy`, unless the user chose a policy on purpose.

    DATA is the strategy layer's decision (`keras_compat.settle_sharding`): an
    AUTO dataset trains with DATA (exact), a policy the user set is kept, and
    FILE is refused before step 1 when `strategy`'s workers outnumber the files.
    """
    import tensorflow as tf

    if policy == "DATA":
        from stratkit.strategy import keras_compat

        return keras_compat.settle_sharding(dataset, strategy)
    options = tf.data.Options()
    current = dataset.options().experimental_distribute.auto_shard_policy
    if current != tf.data.experimental.AutoShardPolicy.AUTO:
        return dataset  # the user chose a policy on purpose (e.g. FILE over many files)
    options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
    return dataset.with_options(options)


def batched_element_spec(element_spec: Any, *, batched: bool) -> Any:
    """`element_spec` as TensorSpecs of batches (a batch dimension added unless `batched`)."""
    import tensorflow as tf

    def one(spec: Any) -> Any:
        shape = spec.shape if batched else tf.TensorShape([None]).concatenate(spec.shape)
        return tf.TensorSpec(shape, spec.dtype)

    return tf.nest.map_structure(one, element_spec)
