"""A `keras.utils.PyDataset`: batches the user made, handed to Keras's own PyDataset adapter.

Used as it is, like a batched dataset: its batch is the global batch (a size
given must be it), and Keras reads it (its `workers`, multiprocessing and
`on_epoch_end` included). Under MultiWorkerMirrored, Keras turns it into a
dataset of whole batches that cannot be sharded by file, so tf.distribute
splits every batch over the replicas (DATA sharding): every worker reads
every batch and trains on its slice, as one process would train on the
whole batch, at the price of each worker reading all the data. It trains as
one process does, batch for batch: the strategy layer keeps Keras's build
from reading it (`keras_compat/trainer_patches.py`) and copies the arrays it
hands TensorFlow before the strategy splits them (`keras_compat/distributed_input.py`).
A Python generator, read once, cannot be repeated for the steps rule: refused
in `inputs.adapter_for`.

Its batch order is its own (`__getitem__`, shuffled in `on_epoch_end` if it
wants): Trainer never asks Keras to reshuffle it (Keras's `shuffle=True`
draws with Python's `random`; in a plain `model.fit` on several workers the
strategy layer has every worker draw the chief's order, `keras_compat/array_shuffle.py`).

Steps rule: a finite PyDataset has `len()` batches; `steps_per_epoch` must
divide that (Keras restarts it only at its end, so any other value would cut
some epochs short). Not for parameter-server training, nor for predict or
evaluation outside the strategy (refused with the alternatives).
"""

from __future__ import annotations

from typing import Any, Callable

from stratkit.errors import ConfigError
from stratkit.training.inputs import rules
from stratkit.training.inputs.base import InputAdapter, PreparedData, WorkerContext

_ALTERNATIVES = ("Fix: pass numpy arrays, a tf.data.Dataset, or a dataset_fn(input_context) (see docs/trainer.md, "
                 "Trainer.fit's data)")


def num_batches(data: Any) -> int | None:
    """`len(data)`, or None for an infinite PyDataset (Keras's `num_batches`)."""
    return data.num_batches


class PyDatasetAdapter(InputAdapter):
    kind = "py_dataset"

    def __init__(self, data: Any, batch_size: int | None = None) -> None:
        super().__init__(data)
        self.batch_size = batch_size

    def _steps(self, steps_per_epoch: int | None, training: bool) -> int | None:
        length = num_batches(self.data)
        if length is None:
            if steps_per_epoch is None and training:
                raise ConfigError("data is an infinite PyDataset (no __len__) and steps_per_epoch=None: an epoch "
                                  "would never end. Fix: pass steps_per_epoch=N")
            return steps_per_epoch
        if steps_per_epoch is not None and training and length % steps_per_epoch:
            divisors = [d for d in range(1, length + 1) if length % d == 0]
            shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
            raise ConfigError(f"steps_per_epoch={steps_per_epoch} does not divide the PyDataset's {length} batches: "
                              "Keras restarts a PyDataset only at its end, so some epochs would run fewer steps. "
                              f"Fix: steps_per_epoch=None (one pass per epoch), or one of {shown}")
        return steps_per_epoch if steps_per_epoch is not None else length

    # -- synchronous strategies ------------------------------------------------------------------
    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        batch = self.batch_size if self.batch_size is not None else rules.py_dataset_batch(self.data)
        rules.check_py_dataset_batch(batch, global_batch_size)
        rules.check_divisible(batch, num_replicas, tpu)
        steps = self._steps(steps_per_epoch, training)
        return PreparedData(self.data, batch, steps, None, self.kind)

    # -- this process only -----------------------------------------------------------------------
    def local(self, global_batch_size: int | None, what: str) -> Any:
        raise ConfigError(f"a keras.utils.PyDataset cannot be read here ({what}: predict on several workers, "
                          f"or parameter-server training). {_ALTERNATIVES}")

    def predict_inputs(self, batch_size: int) -> Any:
        return self.local(batch_size, "data")

    # -- parameter servers -----------------------------------------------------------------------
    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        return self.local(None, "data")

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        return self.local(None, "data")

