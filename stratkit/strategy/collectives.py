"""Small collectives the workers of a multi-worker strategy agree with (every worker must call them, in order).

Both layers need them: the strategy layer's guard for a plain `model.fit`
(the end-of-fit barrier, the resume check of `side_effects.AgreeOnResume`) and
the training layer's `Backup` (the newest epoch every worker has). TensorFlow
is imported at the first call, not with this module.
"""

from __future__ import annotations

import weakref
from typing import Any

_MIN_FUNCTIONS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_CHIEF_FUNCTIONS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def min_over_workers(strategy: Any, value: int) -> int:
    """MIN of an int over every worker of a multi-worker strategy (a collective every worker must call).

    Run in a tf.function: an eager `strategy.run` under MultiWorkerMirroredStrategy
    prints TensorFlow's "Using CollectiveAllReduceStrategy eagerly has significant
    overhead" warning at each call.
    """
    import tensorflow as tf

    function = _MIN_FUNCTIONS.get(strategy)
    if function is None:
        @tf.function
        def function(local: Any) -> Any:
            # ReduceOp has no MIN: gather every worker's value and take the smallest.
            per_replica = strategy.run(lambda: tf.reshape(local, [1]))
            return tf.reduce_min(strategy.gather(per_replica, axis=0))

        _MIN_FUNCTIONS[strategy] = function
    return int(function(tf.constant(value, tf.int64)))


def leave_together(strategy: Any) -> None:
    """Every worker past this point once every worker has reached it, and none gone while another still reads.

    Two rounds of `min_over_workers`. The first is the barrier. It alone is
    not enough before a process ends at once (a Spark or Ray task's training
    process exits right after its function returns): in TensorFlow's ring
    collectives over gRPC each worker pulls the others' chunks, so a worker
    is done once it has read theirs, and it may exit while a slower peer has
    yet to read its own. That peer then fails with UNAVAILABLE "Socket
    closed" (seen once in CI on 2 Spark workers under load). A worker that
    finishes the second round knows every peer has finished the first: each
    peer's chunk of the second round exists only after that. The second round
    can itself meet a peer that finished and left, which is the only way it
    fails here. Then the first round has already held, and the error is ignored.
    """
    import tensorflow as tf

    min_over_workers(strategy, 0)
    try:
        min_over_workers(strategy, 0)
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError):
        pass  # a peer finished both rounds and left: every worker is past the barrier


def gather_ints(strategy: Any, value: int) -> list[int]:
    """Every worker's `value`, chief first (a collective: every worker must call it)."""
    import tensorflow as tf

    per_replica = strategy.run(lambda: tf.constant([value], tf.int64))
    return [int(v) for v in strategy.gather(per_replica, axis=0).numpy()]


_SUM_FUNCTIONS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def sum_over_workers(strategy: Any, values: "list[int] | tuple[int, ...]") -> list[int]:
    """Element-wise SUM of a few ints over every worker (one all-gather of len(values) int64s; every worker calls it).

    The per-step agreement of `stratkit.training.checkpoint` (a preemption
    notice seen by any worker, a backup the chief's clock made due) rides on
    it: a few bytes, one collective per step. Each replica contributes its
    worker's values, so a worker with R replicas counts R times: callers test
    for > 0. In a tf.function, retraced only when the vector's length changes.
    """
    import tensorflow as tf

    function = _SUM_FUNCTIONS.get(strategy)
    if function is None:
        @tf.function
        def function(local: Any) -> Any:
            # An all-gather, as `min_over_workers`: a replica-context all_reduce of a captured tensor is refused
            # under MultiWorkerMirrored ("destinations can not be empty").
            per_replica = strategy.run(lambda: tf.reshape(local, [1, -1]))
            return tf.reduce_sum(strategy.gather(per_replica, axis=0), axis=0)

        _SUM_FUNCTIONS[strategy] = function
    return [int(v) for v in function(tf.constant(list(values), tf.int64)).numpy()]
def chief_ints(strategy: Any, values: list[int]) -> list[int]:
    """The chief's `values` on every worker (a collective: every worker must call it, with as many values).

    In a tf.function, as `min_over_workers`, for TensorFlow's eager-overhead warning.
    """
    import tensorflow as tf

    function = _CHIEF_FUNCTIONS.get(strategy)
    if function is None:
        @tf.function(reduce_retracing=True)
        def function(local: Any) -> Any:
            per_replica = strategy.run(lambda: tf.reshape(local, [1, -1]))
            return strategy.gather(per_replica, axis=0)[0]  # the chief's (first) replica comes first

        _CHIEF_FUNCTIONS[strategy] = function
    return [int(v) for v in function(tf.constant(values, tf.int64)).numpy()]
