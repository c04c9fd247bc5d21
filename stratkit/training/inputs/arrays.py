"""`(x, y)` / `(x, y, sample_weight)` numpy arrays (or `x` alone for predict); dicts of arrays too."""

from __future__ import annotations

from typing import Any

from stratkit.errors import ConfigError
from stratkit.training.inputs.dataset import DatasetAdapter


def numpy_arrays(data: Any) -> tuple:
    """`data` as a checked tuple of 1-3 parts whose arrays all have one row per example."""
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


class ArrayAdapter(DatasetAdapter):
    """numpy arrays: the examples are their rows, shuffled (the same seed on every worker) when training."""

    kind = "numpy"

    def examples(self) -> Any:
        import tensorflow as tf

        arrays = numpy_arrays(self.data)
        return tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])

    def num_examples(self) -> int:
        first = numpy_arrays(self.data)[0]
        return int(len(next(iter(first.values())) if isinstance(first, dict) else first))

    def _check_for_tpu(self) -> None:
        pass  # arrays have static shapes

    def _shuffled(self, dataset: Any, *, buffer: int | None, seed: int) -> Any:
        # reshuffle_each_iteration: a new order on each pass, also within one repeated stream.
        return dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)

    def _epoch_stream(self, *, global_batch_size: int, steps_per_epoch: int | None, drop: bool, seed: int,
                      first_epoch: int, first_step: int = 0) -> Any:
        """Every epoch's batches from `first_epoch` on, one endless stream; pass p's order is a function of (seed, p).

        So a run resumed at epoch E (from `backup_dir`, at another world size,
        or by `initial_epoch`) reads exactly the batches an uninterrupted run
        reads from epoch E on: `dataset.shuffle(reshuffle_each_iteration=True)`
        instead restarts its sequence of orders in every new process. Without
        `steps_per_epoch` an epoch is one pass, ending with its partial batch;
        with it, batches run on across passes (all full), and the resumed stream
        skips the E * steps * batch rows read before. A resume at step S of epoch E
        (a step backup) starts S batches further on: only indices are skipped.
        """
        import tensorflow as tf

        arrays = numpy_arrays(self.data)
        rows = arrays if len(arrays) > 1 else arrays[0]
        n = self.num_examples()
        key = tf.constant(seed % 2**31, tf.int64)

        def order(p: Any) -> Any:
            return tf.data.Dataset.from_tensor_slices(
                tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=tf.stack([key, p])))

        if steps_per_epoch is None:
            indices = tf.data.Dataset.range(first_epoch, 2**62).flat_map(
                lambda p: order(p).batch(global_batch_size, drop_remainder=drop)).skip(first_step)
        else:
            read = (first_epoch * steps_per_epoch + first_step) * global_batch_size
            indices = tf.data.Dataset.range(read // n, 2**62).flat_map(order).skip(read % n)
            indices = indices.batch(global_batch_size, drop_remainder=True)
        return indices.map(lambda i: tf.nest.map_structure(lambda a: tf.gather(a, i), rows),
                           num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def predict_inputs(self, batch_size: int) -> Any:
        import tensorflow as tf

        data = self.data
        inputs = data[0] if isinstance(data, tuple) and len(data) == 1 else data
        return tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size)
