"""The model's variables on the ps, and the chief's exact counters next to them.

Exact counts under asynchronous updates: Keras 3 `Variable.assign_add` is
`assign(self + value)`, so concurrent workers lose increments (measured: 61
scheduled steps, `optimizer.iterations` 53). Steps, examples and every metric
variable are therefore accumulated in raw `tf.Variable`s whose `assign_add` is
one atomic kernel on the ps (`Counters`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratkit.errors import ConfigError
from stratkit.strategy import keras_ps


def check_model(model: Any) -> None:
    """Refuse a model the loop cannot train: a custom `train_step`, or no optimizer."""
    if keras_ps.overrides_train_step(model):
        raise ConfigError(f"{type(model).__name__} overrides train_step, which parameter-server training cannot run: "
                          "its metric updates are not atomic across asynchronous workers. Fix: move custom loss "
                          "logic into compute_loss and custom metrics into compute_metrics (both are used), or train "
                          "with another strategy")
    if getattr(model, "optimizer", None) is None:
        raise ConfigError("the model is not compiled with an optimizer. Fix: call model.compile(optimizer=..., "
                          "loss=...) inside the function passed to trainer.build")


def build(model: Any, element_spec: Any) -> None:
    """Create every variable (model, compiled loss and metrics, optimizer) before training.

    Variables must exist before any closure runs: a scheduled function on a
    worker cannot create them. Call it in the strategy's scope.
    """
    keras_ps.symbolic_build(model, element_spec, optimizer_targets)


def optimizer_targets(model: Any) -> list[Any]:
    """The variables the optimizer updates: the model's, with each sharded one replaced by its shards.

    A `variable_partitioner` makes a Keras variable hold a `ShardedVariable`,
    which Keras 3 cannot differentiate or update (`'ShardedVariable' object has
    no attribute 'handle'`; ParameterServerStrategy updates only single
    variables). Its shards are plain variables, each on its own ps: gradients
    and optimizer updates go to them directly.
    """
    targets: list[Any] = []
    for variable in model.trainable_variables:
        shards = keras_ps.shards_of(variable)
        if shards is None:
            targets.append(variable)
        else:
            keras_ps.allow_saving_sharded()
            targets.extend(shards)
    return targets


def batch_size(x: Any) -> Any:
    """The number of examples in the batch `x` (a tensor)."""
    import tensorflow as tf

    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


class Counters:
    """The atomic counters on the ps: steps, examples, one sum per metric variable.

    Created in the strategy's scope, colocated with the step counter (small,
    and never split by a `variable_partitioner`).
    """

    def __init__(self, strategy: Any, initial: list[np.ndarray]) -> None:
        import tensorflow as tf

        self.initial = initial
        with strategy.scope():
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="stratkit_steps")
            with strategy.extended.colocate_vars_with(self.steps):
                self.examples = tf.Variable(0, dtype=tf.int64, trainable=False, name="stratkit_examples")
                self.sums = [tf.Variable(np.zeros_like(init), trainable=False, name=f"stratkit_sum_{i}")
                             for i, init in enumerate(initial)]

    def add(self, deltas: list[Any], examples: Any) -> Any:
        """Add one step (inside the scheduled function): raw `assign_add`, one locked kernel on the ps."""
        for total, value in zip(self.sums, deltas):
            total.assign_add(value)
        self.examples.assign_add(examples)
        return self.steps.assign_add(1)

    def start_epoch(self) -> int:
        """Zero the per-epoch sums and examples; return the step count now."""
        for total, init in zip(self.sums, self.initial):
            total.assign(np.zeros_like(init))
        self.examples.assign(0)
        return int(self.steps.numpy())

    def epoch_sums(self) -> list[np.ndarray]:
        return [total.numpy() for total in self.sums]
