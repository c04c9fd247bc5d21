"""When a backup is due: `backup_every=K` (every K global steps) or a duration ("30s", "10min", "1h").

A step count is decided alike by every worker (the same steps run
everywhere). A duration is decided by the chief's clock alone: the chief says
"due" at the first step boundary at least that long after the last backup,
and the per-step agreement (`stratkit.training.checkpoint.preemption`) hands
that to every worker, so all of them back up at the same step.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from stratkit.errors import ConfigError

_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0, "mins": 60.0,
          "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0}
_DURATION = re.compile(r"^\s*(?P<number>\d+(\.\d+)?)\s*(?P<unit>[a-z]+)\s*$")


@dataclass(frozen=True)
class Every:
    """A parsed `backup_every`: `steps` (every that many global steps) or `seconds`; neither: epoch backups."""

    steps: int | None = None
    seconds: float | None = None
    text: str = "every epoch"

    @property
    def per_step(self) -> bool:
        return self.steps is not None or self.seconds is not None


def parse_every(value: Any, name: str = "backup_every") -> Every:
    """`value` as a schedule: None (epoch backups), a positive int (steps) or a duration string.

    Raises:
        ConfigError: naming `name`, the value and the forms it takes.
    """
    fix = (f"Fix: {name}=<a positive number of steps>, e.g. {name}=500, or a duration such as {name}=\"30s\", "
           f"\"10min\" or \"1h\" (omit it for a backup after every epoch)")
    if value is None:
        return Every()
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(f"{name}={value!r} is not a whole number of steps or a duration. {fix}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive number of steps. {fix}")
        return Every(steps=value, text=f"every {value} step{'s' if value != 1 else ''}")
    if isinstance(value, str):
        if value.strip().isdigit():
            return parse_every(int(value.strip()), name)
        match = _DURATION.match(value.lower())
        if match and match["unit"] in _UNITS:
            seconds = float(match["number"]) * _UNITS[match["unit"]]
            if seconds > 0:
                return Every(seconds=seconds, text=f"every {value.strip()} (the chief's clock)")
        raise ConfigError(f"{name}={value!r} is not a duration stratkit reads. {fix}")
    raise ConfigError(f"{name}={value!r} is a {type(value).__name__}, not a number of steps or a duration. {fix}")


def check_every(value: Any, backup_dir: Any) -> Every:
    """`backup_every` parsed, refused without a `backup_dir` to write to (`Trainer.fit`'s check)."""
    every = parse_every(value)
    if every.per_step and backup_dir is None:
        raise ConfigError(f"backup_every={value!r} needs backup_dir=<a directory> to write the backups to. Fix: "
                          "pass backup_dir, or drop backup_every")
    return every


class Clock:
    """The local side of a schedule: is a backup due at this step boundary (before the agreement)?"""

    def __init__(self, every: Every, is_chief: bool) -> None:
        self.every = every
        self.is_chief = is_chief
        self.last = time.monotonic()

    def restart(self) -> None:
        """A backup was just written: the duration counts from now."""
        self.last = time.monotonic()

    def steps_due(self, global_step: int) -> bool:
        """Due by step count (every worker decides alike)."""
        return self.every.steps is not None and global_step > 0 and global_step % self.every.steps == 0

    def time_due(self) -> bool:
        """Due by the chief's clock (False on every other worker: the chief's word is shared)."""
        return (self.every.seconds is not None and self.is_chief
                and time.monotonic() - self.last >= self.every.seconds)
