"""How many replicas train in sync: the question every fix for N > 1 replicas asks first.

:mod:`.global_gradient`, :mod:`.float8`, :mod:`.batchnorm`, :mod:`.layer_losses`,
:mod:`.replica_seeds`, :mod:`.replica_state`, :mod:`.synced_logs`, the fit guards and
the replica check act only on a Mirrored/MultiWorkerMirrored strategy with more
than one replica; they all ask here, so none of them imports another for it
(``float8`` once imported ``global_gradient`` inside a function for this, while
``global_gradient`` imports ``float8``: a circle).
"""

from __future__ import annotations

from typing import Any


def replicas_of(strategy: Any) -> int:
    """N for a Mirrored/MWMS strategy with N > 1 replicas, else 0."""
    import tensorflow as tf

    if not isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)):
        return 0
    replicas = int(strategy.num_replicas_in_sync)
    return replicas if replicas > 1 else 0


def sync_replicas() -> int:
    """N when this code runs in a replica context of a Mirrored/MWMS strategy with N > 1 replicas, else 0."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return 0
    return replicas_of(tf.distribute.get_strategy())
