"""Random draws on N replicas: each replica its own numbers, every replica the same seed state.

Cause (Keras 3.11-3.15.1, TF 2.21): a ``keras.random.SeedGenerator`` keeps its
state in a variable (``aggregation="none"``) that a strategy scope mirrors, so
every replica holds an equal copy and advances it identically, and the
TensorFlow backend turns the seed ``next()`` hands out into
``tf.random.stateless_*`` ops. No replica id enters the seed: Dropout, the
random augmentation layers (RandomFlip, RandomTranslation, ...) and
``keras.random.*`` under a ``SeedGenerator`` draw the same numbers on every
replica for its i-th row. Measured: 64 identical rows, 2 replicas, 32 distinct
dropout masks where one process draws 64 (Mirrored and 2 workers alike).

Fix: in a replica context of a Mirrored/MWMS strategy with N > 1 replicas,
the seed ``SeedGenerator.next()`` returns is folded with the global replica
id (``replica_id_in_sync_group``, which counts across the workers of an
MWMS cluster) by ``tf.random.experimental.stateless_fold_in``. The state
variable advances exactly as Keras advances it, on every replica alike, so
the same seed gives the same run and MWMS workers stay bit-identical; only
the value handed out differs per replica. Everywhere else (one device, one
replica, eager code, the cross-replica context, a ``tf.data`` pipeline) the
value is Keras's own, bit for bit.

What "as one process" means for randomness: the statistics of one process,
not its bits. One process draws one mask per row of the global batch; N
replicas now draw one mask per row too (no mask repeats across replicas for
identical rows), from other streams, so a run with dropout or augmentation
follows a different (equally distributed) random path than one process with
the same seed. An integer ``seed=`` passed straight to ``keras.random.*`` is
a fixed stateless seed, not a generator, and is left as it is.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from stratkit.strategy.keras_compat.replicas import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

_lock = threading.Lock()
_originals: dict[str, Any] = {}


def _seed_generator_class() -> type:
    import keras

    return keras.random.SeedGenerator


def replica_seed(seed: Any) -> Any:
    """``seed`` folded with the global replica id in a replica context of N > 1 replicas, else ``seed`` itself."""
    import tensorflow as tf

    if not tf.is_tensor(seed) or not sync_replicas():
        return seed
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.random.experimental.stateless_fold_in(seed, tf.cast(replica, seed.dtype))


def next(self: Any, ordered: bool = True) -> Any:  # noqa: A001 - the method it replaces
    """Replacement for ``SeedGenerator.next``: Keras's value and state update, then the replica fold."""
    return replica_seed(_originals["next"](self, ordered))


setattr(next, _PATCH_MARK, True)


def install() -> None:
    """Wrap ``SeedGenerator.next`` (idempotent); on a Keras without it, say so and leave Keras's."""
    cls = _seed_generator_class()
    current = cls.__dict__.get("next")
    if not callable(current):
        log.warning("this Keras's SeedGenerator has no next(): replicas draw the same random numbers "
                    "(dropout masks, augmentations) for their i-th rows.")
        return
    with _lock:
        if not getattr(current, _PATCH_MARK, False):
            _originals["next"] = current
            cls.next = next


def uninstall() -> None:
    """Give Keras its method back (for tests)."""
    with _lock:
        if "next" in _originals:
            _seed_generator_class().next = _originals.pop("next")
