"""The step state a backup holds beside the weights file, and the checks a resume makes against it.

`RunFacts` are what must match for a resume to continue the same run (the
global batch, steps per epoch, dataset size; world size and replicas are
recorded, and may change: the position is counted in global steps of the
global batch). `model_state` / `restore_*` are the parts of a model the
weights file does not hold:

* the random state: every `keras.random.SeedGenerator` state (Dropout's, the
  augmentation layers', the user's), which `model.variables` lists and
  `save_weights` leaves out (measured, Keras 3.15.1);
* the compiled metrics' state at the step (their running totals and counts),
  so the resumed epoch's logged means equal the uninterrupted run's: Keras
  resets them at every epoch's start, and the backup callback puts them back
  right after that reset;
* the learning rate at the step (it is in the weights file too, but a
  callback's `on_epoch_begin` may move it again when a mid-epoch resume
  re-enters the epoch: it is put back at the first step);
* a manifest of the model's variables (names and shapes), so a backup from
  another model is refused naming the first difference before anything is loaded.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from stratkit.errors import ConfigError

FORMAT = 2


@dataclass(frozen=True)
class RunFacts:
    """What a run's data and batching are; a resume mid-epoch needs the same global batch, steps and rows."""

    global_batch_size: int | None = None
    steps_per_epoch: int | None = None
    dataset_rows: int | None = None
    world_size: int = 1
    replicas: int = 1
    data_kind: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict | None) -> "RunFacts":
        value = dict(value or {})
        return cls(**{k: value[k] for k in cls.__dataclass_fields__ if k in value})


def check_facts(saved: RunFacts, now: RunFacts, epoch: int, step: int, directory: str) -> str | None:
    """Refuse a resume that cannot continue the backup's run; a note when it continues with a change.

    Mid-epoch (step > 0) the global batch, the steps per epoch and the dataset's
    rows must be the backup's: the position counts global batches of that size.
    At an epoch boundary a different batch or dataset is accepted (the next
    epoch starts afresh), and said. A different world size is fine: the global
    batch is kept and the position is global.

    Raises:
        ConfigError: naming both numbers and the fix.
    """
    changes = []
    for name, old, new in (("global batch", saved.global_batch_size, now.global_batch_size),
                           ("steps per epoch", saved.steps_per_epoch, now.steps_per_epoch),
                           ("dataset size (rows)", saved.dataset_rows, now.dataset_rows)):
        if old is not None and new is not None and old != new:
            changes.append((name, old, new))
    if changes and step > 0:
        name, old, new = changes[0]
        raise ConfigError(f"backup_dir={directory!r} holds a backup at epoch {epoch} + {step} steps of a run with "
                          f"{name} {old}, but this run has {name} {new}: the position inside the epoch would not "
                          f"be the same data. Nothing was changed. Fix: run with {name} {old} to continue it, or "
                          "move the backup away to start over")
    notes = [f"{name} {old} -> {new}" for name, old, new in changes]
    if saved.world_size != now.world_size or saved.replicas != now.replicas:
        notes.append(f"world size {saved.world_size} -> {now.world_size} ({saved.replicas} -> {now.replicas} "
                     "replicas; the global batch is kept)")
    return "; ".join(notes) or None


# --------------------------------------------------------------------------------------------
# Model state beside the weights file
# --------------------------------------------------------------------------------------------


def _value(variable: Any) -> list:
    import numpy as np

    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable).tolist()


def manifest(model: Any) -> list[list]:
    """[name, shape] of every weight, in order (the path without its model's name)."""
    return [[str(v.path).split("/", 1)[-1], list(v.shape)] for v in model.weights]


def _same_name(old: str, new: str) -> bool:
    """Names equal but for Keras's auto-numbering (`dense_4/kernel` in a process that built other models first)."""
    def plain(name: str) -> list[str]:
        return [re.sub(r"_\d+$", "", part) for part in name.split("/")]

    return plain(old) == plain(new)


def check_manifest(saved: list | None, model: Any, path: str) -> None:
    """Refuse a backup whose variables differ from `model`'s, naming the first difference (nothing is loaded).

    Raises:
        ConfigError: naming the variable, both shapes (or names) and the file.
    """
    if saved is None:
        return
    now = manifest(model)
    for index, (old, new) in enumerate(zip(saved, now)):
        if list(old[1]) != new[1] or not _same_name(old[0], new[0]):
            raise ConfigError(f"cannot resume from {path}: it was written by another model. Variable {index}: the "
                              f"backup has {old[0]} {tuple(old[1])}, this model has {new[0]} {tuple(new[1])}. Nothing "
                              "was loaded or deleted. Fix: build the same model as the run that wrote the backup, "
                              "or move the backup directory away to start over")
    if len(saved) != len(now):
        longer, which = (saved, "the backup") if len(saved) > len(now) else (now, "this model")
        first = longer[min(len(saved), len(now))]
        raise ConfigError(f"cannot resume from {path}: it was written by another model: the backup has {len(saved)} "
                          f"variables, this model {len(now)}; the first one only {which} has is {first[0]} "
                          f"{tuple(first[1])}. Nothing was loaded or deleted. Fix: build the same model as the run "
                          "that wrote the backup, or move the backup directory away to start over")


def _random_variables(model: Any) -> list:
    """The model's variables that are not weights: the seed generators' states."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _metric_variables(model: Any) -> list:
    return [v for metric in model.metrics for v in metric.variables]


def model_state(model: Any) -> dict[str, Any]:
    """The random state, metric state and learning rate of `model` now (collective reads on several workers)."""
    optimizer = getattr(model, "optimizer", None)
    rate = getattr(optimizer, "learning_rate", None) if optimizer is not None else None
    learning_rate = None
    if rate is not None and hasattr(rate, "assign"):
        learning_rate = float(_value(rate))
    return {"random": [[str(v.path), _value(v)] for v in _random_variables(model)],
            "metrics": [[str(v.path), _value(v)] for v in _metric_variables(model)],
            "learning_rate": learning_rate, "variables": manifest(model)}


def _assign(variables: list, saved: list | None, what: str) -> None:
    if not saved:
        return
    if len(saved) != len(variables):
        raise ConfigError(f"the backup holds {len(saved)} {what} variables, this model {len(variables)}. Fix: "
                          "build and compile the same model (metrics included) as the run that wrote the backup")
    for variable, (_, value) in zip(variables, saved):
        variable.assign(value)


def restore_random(model: Any, state: dict) -> None:
    _assign(_random_variables(model), state.get("random"), "random-state")


def restore_metrics(model: Any, state: dict) -> None:
    """Put the metrics' running state back (call it after Keras's reset at the epoch's start)."""
    _assign(_metric_variables(model), state.get("metrics"), "metric")


def restore_learning_rate(model: Any, state: dict) -> None:
    rate = state.get("learning_rate")
    variable = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    if rate is not None and variable is not None and hasattr(variable, "assign"):
        variable.assign(rate)
