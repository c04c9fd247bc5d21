"""Gradient accumulation (``gradient_accumulation_steps``) on N > 1 Mirrored/MWMS replicas.

Keras chooses "update" or "accumulate" with a ``cond`` in the replica context,
where the update's ``merge_call`` is not allowed (keras-team/keras#20582).
Here the choice is made in the cross-replica context and each branch runs on
every replica (as Keras's LossScaleOptimizer does). In fit the gradients arrive
all-reduced (:mod:`.global_gradient`): every replica accumulates and applies
one process's values. In a custom loop, Keras's convention: each replica
accumulates its own gradient, and the update all-reduces each replica's
``(gradient + accumulated) / k``, then clips and applies it alike everywhere.
Called by :mod:`.global_gradient`'s replacement of ``_backend_apply_gradients``
(moved here from it to keep that module under the size limit).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def apply_on_replicas(optimizer: Any, grads: Any, trainable_variables: Any, arrived_reduced: bool,
                      reduced: Callable[[], AbstractContextManager[None]]) -> None:
    """One accumulation step of `optimizer` in a replica context.

    Args:
        optimizer: a Keras optimizer with ``gradient_accumulation_steps``.
        grads: this replica's gradients (all-reduced already when `arrived_reduced`).
        trainable_variables: the variables they belong to.
        arrived_reduced: the gradients are all-reduced (fit), else each replica's own (a custom loop).
        reduced: the context in which the optimizer's own all-reduce is skipped (gradients reduced).
    """
    import tensorflow as tf
    from keras.src import ops

    self = optimizer
    steps = self.gradient_accumulation_steps
    accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]

    def update(grads: Any) -> None:
        grads = [(g + a) / steps for g, a in zip(grads, accumulators)]
        if not arrived_reduced:     # each replica's own (gradient + sum) / k: new tensors, summed over replicas
            grads = [g for g, _ in self._all_reduce_sum_gradients(list(zip(grads, trainable_variables)))]
        with reduced():
            grads = self._clip_gradients(grads)
            self._apply_weight_decay(trainable_variables)
            self._backend_update_step(grads, trainable_variables, self.learning_rate)
            self._backend_reset_gradient_accumulators()

    def accumulate(grads: Any) -> None:
        self._backend_increment_gradient_accumulators(grads, accumulators)

    def choose(distribution: Any, grads: Any) -> None:
        each = distribution.extended.call_for_each_replica
        ops.cond((self._iterations + 1) % steps == 0, lambda: each(update, args=(grads,)),
                 lambda: each(accumulate, args=(grads,)))

    tf.distribute.get_replica_context().merge_call(choose, args=(grads,))
    if self.use_ema:
        self._update_model_variables_moving_average(self._trainable_variables)
        if self.ema_overwrite_frequency:
            ops.cond((self.iterations + 1) % self.ema_overwrite_frequency == 0,
                     lambda: self._overwrite_model_variables_with_average_value(self._trainable_variables),
                     lambda: None)
