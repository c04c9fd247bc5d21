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

    def predict_inputs(self, batch_size: int) -> Any:
        import tensorflow as tf

        data = self.data
        inputs = data[0] if isinstance(data, tuple) and len(data) == 1 else data
        return tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size)
