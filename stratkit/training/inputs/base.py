"""The one interface every input kind offers, and what `prepare` returns.

Chosen once per input by `stratkit.training.inputs.adapter_for`; after that
no caller asks which kind it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: Returns the `tf.distribute.InputContext` of the worker a parameter-server closure runs on.
WorkerContext = Callable[[], Any]


@dataclass
class PreparedData:
    """A dataset ready for `model.fit`/`evaluate`/`predict` under the strategy."""

    dataset: Any
    global_batch_size: int | None
    steps_per_epoch: int | None
    num_examples: int | None
    kind: str  # "numpy", "dataset", "batched_dataset" or "dataset_fn"
    #: The dataset runs on across epochs (numpy arrays reshuffled by epoch): `fit` needs `steps_per_epoch`.
    endless: bool = False
    #: Batches the first epoch of a mid-epoch resume must read and drop (a pass that cannot start at a step).
    replay: int = 0
    #: What a backup records of the input's order (a table's snapshot and order settings; None: nothing).
    record: dict | None = None
    #: The reader's own failure behind an error TensorFlow's input pipeline raised (a table input), or None.
    failure: Callable[[], BaseException | None] | None = None


class InputAdapter:
    """What `fit`, `evaluate`, `predict` and the parameter-server loop need of the user's data.

    Subclasses: `ArrayAdapter` (numpy arrays), `DatasetAdapter` (an unbatched
    `tf.data.Dataset`), `BatchedDatasetAdapter` (batched with the global
    batch), `DatasetFnAdapter` (`dataset_fn(input_context)`).
    """

    kind = ""

    def __init__(self, data: Any) -> None:
        self.data = data

    # -- synchronous strategies ------------------------------------------------------------------
    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        """The dataset for one of the strategy's fit/evaluate/predict (see `inputs.prepare`)."""
        raise NotImplementedError

    # -- this process only -----------------------------------------------------------------------
    def local(self, global_batch_size: int | None, what: str) -> Any:
        """One local, finite, batched dataset: no sharding, no shuffling, no repeat."""
        raise NotImplementedError

    def predict_inputs(self, batch_size: int) -> Any:
        """Local batches of the model's inputs only (`(x, y)` elements read as Keras reads them)."""
        import keras

        return self.local(batch_size, "data").map(lambda *element: keras.utils.unpack_x_y_sample_weight(
            element[0] if len(element) == 1 else element)[0])

    # -- parameter servers -----------------------------------------------------------------------
    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        """The element spec of a training batch, read on the chief without running the pipeline."""
        raise NotImplementedError

    def check_worker_shards(self, global_batch_size: int | None, num_workers: int, num_replicas: int) -> None:
        """Every worker's shard must hold at least one step, or its repeated stream is empty."""

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        """dataset_fn(ps_input_context) run on each worker: its own shard, repeated forever, batched.

        ParameterServerStrategy hands every worker the same InputContext
        (pipeline 0 of 1); `context()` gives the worker's real one at call time.
        """
        raise NotImplementedError


def per_step_rows(size: int, global_batch_size: int, num_workers: int, num_replicas: int) -> None:
    """Refuse example-sharded data in which a worker's share is smaller than one step's batch."""
    from stratkit.errors import ConfigError

    per_step = global_batch_size // max(num_replicas, 1)
    if size // num_workers < per_step:
        raise ConfigError(f"data has {size} examples: each of the {num_workers} workers reads {size // num_workers}, "
                          f"fewer than one step's batch of {per_step} (global_batch_size={global_batch_size}). "
                          f"Fix: use global_batch_size <= {max(size // num_workers, 1) * max(num_replicas, 1)}, "
                          "or pass more data")

