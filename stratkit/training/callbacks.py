"""Callbacks stratkit adds to `fit`: throughput, learning-rate scaling with warmup, the timeline's marks.

The chief-only rules for side effects (progress bar, TensorBoard, checkpoints)
are in `stratkit.strategy.side_effects`, since the strategy layer's guard for a
plain `model.fit` applies them too; their names stay importable from here.
"""

from __future__ import annotations

import time
from typing import Any

import keras

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.strategy import keras_compat
from stratkit.strategy.side_effects import AgreeOnResume, default_verbose, remove_dirs, route_side_effects

__all__ = ["AgreeOnResume", "LinearScalingWarmup", "PhaseMarks", "Throughput", "default_verbose", "remove_dirs",
           "route_side_effects"]

log = status.logger(__name__)


class Throughput(keras.callbacks.Callback):
    """Report examples/sec per epoch (a status line on the chief; added to the epoch logs).

    It has no per-batch hook on purpose: any `on_train_batch_end` makes Keras
    synchronise with the device after every step (measured: ~20% fewer
    steps/sec on a small MLP). It times the epoch up to the start of validation
    and counts the steps that really ran as the change of
    `optimizer.iterations` over the epoch (read twice per epoch), not the
    steps asked for: an epoch stopped early (`model.stop_training`) or cut
    short by data that ran out reports what it did. Without an optimizer it
    falls back to Keras' `params["steps"]`.

    An epoch that is one whole pass over data of known size (`epoch_examples` rows in `epoch_steps` steps, the
    last batch partial) counts its rows, not its steps times the batch.

    Args:
        global_batch_size: examples per step across the cluster.
        epoch_examples: the rows of one pass, when an epoch is one pass (None: unknown, or every batch full).
        epoch_steps: the steps of that pass.
        verbose: print a line per epoch (stratkit turns this off on non-chief workers).
    """

    def __init__(self, global_batch_size: int, verbose: bool = True, epoch_examples: int | None = None,
                 epoch_steps: int | None = None) -> None:
        super().__init__()
        self.global_batch_size = int(global_batch_size)
        self.epoch_examples = epoch_examples
        self.epoch_steps = epoch_steps
        self.verbose = verbose
        self.history: list[float] = []
        self._start = 0.0
        self._train_end: float | None = None
        self._iterations_at_start: int | None = None

    def get_state(self) -> dict:
        """The rates so far, for a backup (`stratkit.training.checkpoint`)."""
        return {"history": list(self.history)}

    def set_state(self, state: dict) -> None:
        self.history = [float(v) for v in state.get("history", [])]

    def _iterations(self) -> int | None:
        iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
        return None if iterations is None else int(keras.ops.convert_to_numpy(iterations))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._iterations_at_start = self._iterations()
        self._start = time.perf_counter()
        self._train_end = None

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self._train_end is None:  # validation inside fit: training steps are over
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        seconds = max((self._train_end or time.perf_counter()) - self._start, 1e-9)
        end = self._iterations()
        if end is not None and self._iterations_at_start is not None:
            steps = end - self._iterations_at_start
        else:
            steps = (self.params or {}).get("steps")
        if not steps:
            return  # unknown epoch length, or nothing ran: nothing honest to report
        whole_pass = self.epoch_examples is not None and steps == self.epoch_steps
        examples = self.epoch_examples if whole_pass else steps * self.global_batch_size
        rate = examples / seconds
        self.history.append(rate)
        if logs is not None:
            logs["examples_per_sec"] = rate
        if self.verbose:
            log.info("epoch %d: %s examples/sec (%d examples in %d steps of global batch %d, %.2fs)", epoch + 1,
                     f"{rate:,.0f}", examples, steps, self.global_batch_size, seconds)


def _learning_rate_variable(model: Any) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ConfigError("scale_learning_rate=True needs a compiled model. Fix: call model.compile(optimizer=...) "
                          "in the function passed to trainer.build")
    configured = keras_compat.configured_learning_rate(optimizer)
    if isinstance(configured, keras.optimizers.schedules.LearningRateSchedule) or callable(configured):
        raise ConfigError(f"scale_learning_rate=True needs a constant learning rate, but the optimizer uses "
                          f"{type(configured).__name__}. Fix: scale the schedule's initial rate by "
                          "trainer.num_replicas yourself and pass scale_learning_rate=False")
    return optimizer.learning_rate


class LinearScalingWarmup(keras.callbacks.Callback):
    """The linear scaling rule with gradual warmup (Goyal et al. 2017).

    The learning rate goes linearly from the compiled rate `lr` to `lr x scale`
    over the first `warmup_epochs` epochs (per step), then stays at `lr x scale`.

    Args:
        scale: the factor, normally the number of replicas.
        warmup_epochs: epochs of warmup (0: scale at once).
        steps_per_epoch: steps in one epoch (needed for a per-step ramp).
    """

    def __init__(self, scale: float, warmup_epochs: int = 0, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if warmup_epochs and not steps_per_epoch:
            raise ConfigError("warmup_epochs needs the number of steps per epoch. Fix: pass steps_per_epoch=N "
                              "to fit when the data's length is unknown")
        self.scale = float(scale)
        self.warmup_epochs = int(warmup_epochs)
        self.steps_per_epoch = steps_per_epoch
        self.base_lr: float | None = None
        self._epoch = 0

    def get_state(self) -> dict:
        """The compiled rate it scales, for a backup: a resumed run reads the optimizer's scaled rate instead."""
        return {"base_lr": self.base_lr}

    def set_state(self, state: dict) -> None:
        if state.get("base_lr") is not None:
            self.base_lr = float(state["base_lr"])

    def on_train_begin(self, logs: dict | None = None) -> None:
        variable = _learning_rate_variable(self.model)
        if self.base_lr is None:
            self.base_lr = float(keras.ops.convert_to_numpy(variable))
        self._set(self._rate(0, 0))

    def _rate(self, epoch: int, batch: int) -> float:
        assert self.base_lr is not None
        if self.warmup_epochs <= 0:
            return self.base_lr * self.scale
        progress = min((epoch * self.steps_per_epoch + batch) / (self.warmup_epochs * self.steps_per_epoch), 1.0)
        return self.base_lr * (1.0 + (self.scale - 1.0) * progress)

    def _set(self, value: float) -> None:
        self.model.optimizer.learning_rate.assign(value)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.warmup_epochs > 0 and self._epoch <= self.warmup_epochs:
            self._set(self._rate(self._epoch, batch))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class PhaseMarks(keras.callbacks.Callback):
    """Mark the first step and the end of training on the launcher's timeline (`stratkit.timeline`).

    Only `on_train_batch_begin` for the first two batches (the second one's
    begin is the first step done: tracing and the first collective are in it);
    no batch-end hook, which would make Keras synchronise after every step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._batches = 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._batches < 2:
            from stratkit import timeline

            timeline.mark("first step begins" if self._batches == 0 else "first step done")
            self._batches += 1

    def on_train_end(self, logs: dict | None = None) -> None:
        from stratkit import timeline

        timeline.mark("training ends")
