"""Small reads and writes of Keras/TensorFlow private state that stratkit's training code needs.

Each has no public equivalent in the Keras/TF versions stratkit supports; each
says why it is needed. Keeping them here (not in the training layer, ``training/``) puts
every private use behind the gate, where the compat suite proves it per
version and ``tests/strategy/test_private_api_gate.py`` lists it.
"""

from __future__ import annotations

from typing import Any

#: Transformations after which a dataset's elements are still batches if they were before
#: (TensorFlow 2.21 class names, leading underscores removed).
_KEEP_BATCHES = frozenset({"PrefetchDataset", "OptionsDataset", "CacheDataset", "RepeatDataset", "TakeDataset",
                           "SkipDataset", "ShuffleDataset", "FilterDataset", "MapDataset", "ParallelMapDataset",
                           "ShardDataset", "AssertCardinalityDataset", "IgnoreErrorsDataset"})


def resume_epoch(model: Any) -> int:
    """The epoch a `fit` about to start resumes at (set by Keras's BackupAndRestore; 0 for none).

    ``BackupAndRestore`` hands the epoch to ``fit`` through the model's private
    ``_initial_epoch``.
    """
    return int(getattr(model, "_initial_epoch", None) or 0)


def set_resume_epoch(model: Any, epoch: int | None) -> None:
    """Make the `fit` that is starting resume at `epoch` (None: forget it, at the end of training).

    The same hand-over Keras's own ``BackupAndRestore`` uses: ``fit`` reads the
    model's ``_initial_epoch`` once, after ``on_train_begin``.
    """
    model._initial_epoch = epoch


def configured_learning_rate(optimizer: Any) -> Any:
    """What the optimizer was given as its learning rate: a variable, a schedule or a callable.

    The public ``optimizer.learning_rate`` evaluates a schedule at the current
    step, so it cannot tell a constant rate from a schedule; Keras keeps what
    was passed in ``_learning_rate``.
    """
    return optimizer._learning_rate


def dataset_batch_size(dataset: Any) -> int | None:
    """The batch size of a `tf.data.Dataset` whose elements are batches, else None (-1: batched, size unknown).

    `ds.batch(64).prefetch(...)` is how Keras users write input pipelines, so
    the batch is looked for upstream through transformations that keep
    elements whole (`_KEEP_BATCHES`), stopping at `unbatch`. tf.data has no
    public way to ask this: it walks the private `_input_dataset` links and
    reads `_batch_size` (`_batch_sizes` for `rebatch`). An unknown class ends
    the walk: the dataset is then taken as unbatched, as before.
    """
    node = dataset
    for _ in range(64):  # pipelines are short; never loop on a strange graph
        name = type(node).__name__.lstrip("_")
        if name == "UnbatchDataset":
            return None
        if name.endswith("BatchDataset"):  # Batch, ParallelBatch, PaddedBatch, Rebatch, MapAndBatch
            size = getattr(node, "_batch_size", getattr(node, "_batch_sizes", None))
            try:
                return int(size)
            except (TypeError, ValueError):
                return -1
        if name not in _KEEP_BATCHES:
            return None
        node = getattr(node, "_input_dataset", None)
        if node is None:
            return None
    return None


def runtime_initialized() -> bool:
    """True when TensorFlow's eager runtime already started (devices and collectives are fixed).

    TensorFlow has no public question for this; its eager context holds a
    handle once the runtime started.
    """
    try:
        from tensorflow.python.eager import context
    except ImportError:  # pragma: no cover - TF is a hard dependency
        return False
    return getattr(context.context(), "_context_handle", None) is not None


def per_replica_optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables Keras keeps per replica on purpose: gradient accumulators.

    In a custom loop each replica accumulates its own gradient (Keras's convention, kept by
    ``global_gradient``), so their copies differ between replicas by design; the replica check skips them.
    Keras keeps them in the private ``_accumulated_gradients``.
    """
    return [v for v in (getattr(optimizer, "_accumulated_gradients", None) or ()) if v is not None]
