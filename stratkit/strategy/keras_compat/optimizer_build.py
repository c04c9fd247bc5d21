"""An optimizer the user applies himself is built where its variables can be mirrored.

Cause (Keras 3.15.1, TF 2.21): a Keras optimizer creates its slot variables
(Adam's moments, RMSprop's averages, ...) on its first ``apply``. In a custom
training loop (TensorFlow's custom-training-loop tutorial, a GAN's two
optimizers) that first ``apply`` runs inside ``strategy.run``, in a replica
thread of the traced ``tf.function``. On a MirroredStrategy with several local
devices the second device's copy takes the first copy's initial value, which
the function leaves as an unfed placeholder: step 1 dies with
``InvalidArgumentError: You must feed a value for placeholder tensor
'cond/else/_1/cond/Placeholder'`` (plain Keras too). ``model.fit`` is safe:
Keras builds its optimizer before the first step. One device per process
(MultiWorkerMirrored's usual layout, one device) is safe too.

Fix: on the first ``apply`` of an unbuilt optimizer in a replica context of a
strategy with several local devices, one ``merge_call`` builds it in the
cross-replica context, eagerly (``tf.init_scope``), as
``optimizer.build(model.trainable_variables)`` in the scope would: the slots
are mirrored variables initialised like any other. Every case is built so, no
refusal is needed: where a ``merge_call`` is not allowed (a first ``apply``
inside a ``tf.cond`` of the replica function) the gradient all-reduce that
follows is not allowed either, with or without a built optimizer, and
TensorFlow's own error says so. Called by :mod:`.global_gradient`'s
``apply``, the one place stratkit wraps ``apply``.
"""

from __future__ import annotations

from typing import Any


def _local_devices(strategy: Any) -> int:
    return len(getattr(strategy.extended, "worker_devices", ()))


def build_outside_replicas(optimizer: Any, variables: Any) -> None:
    """Build an unbuilt `optimizer` for `variables` in the cross-replica context (see the module docstring).

    Does nothing when the optimizer is built, no variables are given (Keras then refuses by itself), or
    this is not a replica context of a strategy with several local devices.
    """
    if getattr(optimizer, "built", True) or variables is None:
        return
    import tensorflow as tf
    from keras.src import backend

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)) or \
            _local_devices(strategy) < 2:
        return                      # one device per process builds in place; a PS loop builds up front
    variables = list(variables)

    def build(distribution: Any) -> None:
        if optimizer.built:          # another replica thread's merge_call came first
            return
        with tf.init_scope(), distribution.scope(), backend.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True

    tf.distribute.get_replica_context().merge_call(build)
