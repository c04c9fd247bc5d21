"""The model's metrics under asynchronous workers: each step's contribution, summed exactly.

A step computes its metric update without touching the Keras metric
variables (`keras.StatelessScope`: the update applied to the reset state gives
this batch's contribution), and the caller adds that contribution atomically
(`variables.Counters`). That is exact for metrics whose state is a sum (Mean,
accuracy, AUC, precision/recall, ...: every Keras metric variable with
aggregation "sum").
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from stratkit import status
from stratkit.strategy import keras_compat, keras_ps
from stratkit.training.ps.variables import batch_size

log = status.logger(__name__)


class Metrics:
    """The model's metrics (loss tracker, compiled and custom), updated by deltas.

    `step` runs the model's loss and metric code against the *reset* metric
    state inside a `keras.StatelessScope`, so nothing is written to the Keras
    variables; the new state minus the reset state is this batch's
    contribution, which the caller sums (atomically on the ps, or locally).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.variables = list(model.metrics_variables)
        model.reset_metrics()
        self.initial = [np.asarray(keras.ops.convert_to_numpy(v)) for v in self.variables]
        self.names = [v.path for v in self.variables]
        odd = sorted({v.path for v in self.variables if str(getattr(v, "aggregation", "sum")) != "sum"})
        if odd:
            log.warning("metric variable(s) %s are not sums (aggregation != 'sum'): stratkit adds their per-step "
                        "updates, so their epoch values may be approximate under asynchronous training", odd)

    @classmethod
    def of(cls, model: Any) -> "Metrics":
        """The model's `Metrics`, one per model, rebuilt when its metrics change (a recompile)."""
        state = keras_ps.model_state(model)
        cached = state.metrics
        if cached is None or [id(v) for v in cached.variables] != [id(v) for v in model.metrics_variables]:
            cached = state.metrics = cls(model)
        return cached

    def step(self, x: Any, y: Any, sample_weight: Any, y_pred: Any, training: bool) -> tuple[Any, list[Any]]:
        """(loss for the gradient, per-variable metric deltas) for one batch."""
        import tensorflow as tf

        model = self.model
        mapping = [(v, tf.constant(value)) for v, value in zip(self.variables, self.initial)]
        # Read outside the scope: add_loss losses of the forward pass and the weights' regularization.
        extra_losses = list(model.losses)
        with keras.StatelessScope(state_mapping=mapping) as scope, \
                keras_compat.model_losses_override(model, extra_losses):
            loss = keras_ps.compute_loss(model, x, y, y_pred, sample_weight, training=training)
            keras_ps.update_loss_tracker(model, loss, batch_size(x))
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        deltas = []
        for (variable, reset) in mapping:
            new = scope.get_current_value(variable)
            deltas.append(tf.zeros_like(reset) if new is None else tf.cast(new, reset.dtype) - reset)
        return loss, deltas

    def results(self, deltas: list[Any]) -> dict[str, Any]:
        """The metrics' values for accumulated deltas (what `model.fit` logs)."""
        import tensorflow as tf

        mapping = [(v, tf.constant(init + np.asarray(d, dtype=init.dtype)))
                   for v, init, d in zip(self.variables, self.initial, deltas)]
        with keras.StatelessScope(state_mapping=mapping):
            logs = self.model.get_metrics_result()
        out: dict[str, Any] = {}
        for name, value in logs.items():
            array = np.asarray(keras.ops.convert_to_numpy(value))
            out[name] = float(array) if array.ndim == 0 else array.tolist()
        return out

    def evaluate(self, dataset: Any) -> dict[str, Any]:
        """One local pass over a finite batched dataset (no training)."""
        import tensorflow as tf

        model = self.model

        def test_step(batch: Any) -> list[Any]:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            y_pred = keras_ps.call_model(model, x, training=False)
            return self.step(x, y, sample_weight, y_pred, training=False)[1]

        state = keras_ps.model_state(model)
        if state.test_function is None or state.test_function[0] is not self:
            state.test_function = (self, tf.function(test_step, reduce_retracing=True))
        totals = [np.zeros_like(init) for init in self.initial]
        for batch in dataset:
            for i, delta in enumerate(state.test_function[1](batch)):
                totals[i] = totals[i] + delta.numpy()
        return self.results(totals)
