"""Every dataset a stratkit Mirrored/MWMS strategy distributes: its sharding settled, Python's tensors copied.

Measured (TF 2.21, Keras 3.15.1, a local MirroredStrategy over 2 CPUs and 2
MWMS workers; also with ``tf.distribute`` alone, no Keras): a tensor that
``tf.data.Dataset.from_generator`` (or ``tf.py_function``) makes from a NumPy
array can share the array's memory (seen for 64-byte aligned arrays). Once
the strategy splits the batch between the replicas, an op of the step may
write its result into that memory (TensorFlow reuses an input's buffer it
believes no one else holds): the user's own array is overwritten, and the
next epoch trains on the overwritten rows. Keras reads a ``PyDataset`` and a
Python generator through ``from_generator``, so the common ``__getitem__``
that returns ``self.x[lo:hi]`` lost rows this way on 2 replicas (in about one
run in four: whether an array is so aligned changes from run to run); one
device never split the batch and never lost any. The fix: a pipeline that
gets tensors from Python gets one more step, a copy of each tensor
(``DeepCopy``) into memory of TensorFlow's own, before the strategy splits it.

The same wrapper settles the auto-shard policy on several workers
(:mod:`.sharding`). Both are applied by wrapping this strategy object's
``experimental_distribute_dataset``, which Keras's ``fit``/``evaluate``/``predict``
and custom training loops alike call; installed by ``make_strategy`` for
Mirrored and MultiWorkerMirrored strategies (:func:`install`).
"""

from __future__ import annotations

import functools
from typing import Any

from stratkit.strategy.keras_compat import dataset_graph, sharding
from stratkit.strategy.keras_compat.versions import _PATCH_MARK


def own_buffers(dataset: Any) -> Any:
    """`dataset`, each dense tensor copied into TensorFlow's own memory when the pipeline gets tensors from Python."""
    import tensorflow as tf

    if tf.executing_eagerly() and not dataset_graph.reads_python(dataset):
        return dataset  # made by TensorFlow from the start: nothing shares Python's memory
    spec = dataset.element_spec

    @tf.autograph.experimental.do_not_convert
    def copy(*parts: Any) -> Any:
        element = parts if isinstance(spec, tuple) else parts[0]  # tf.data passes a tuple's parts as arguments
        return tf.nest.pack_sequence_as(spec, [tf.raw_ops.DeepCopy(x=t) if isinstance(t, tf.Tensor) else t
                                               for t in tf.nest.flatten(element)])

    return dataset.map(copy)


def install(strategy: Any) -> Any:
    """Wrap `strategy.experimental_distribute_dataset` (this object only; idempotent) and return `strategy`."""
    method = strategy.experimental_distribute_dataset
    if getattr(method, _PATCH_MARK, False):
        return strategy
    workers = sharding.workers_of(strategy)
    replicas = int(getattr(strategy, "num_replicas_in_sync", 1) or 1)

    @functools.wraps(method)
    def distribute(dataset: Any, *args: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        if isinstance(dataset, tf.data.Dataset):
            if workers > 1:
                dataset = sharding.settle(dataset, workers)
            if replicas > 1:
                dataset = own_buffers(dataset)
        return method(dataset, *args, **kwargs)

    setattr(distribute, _PATCH_MARK, True)
    strategy.experimental_distribute_dataset = distribute
    return strategy
