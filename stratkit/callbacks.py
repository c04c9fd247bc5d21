"""Public callbacks: `stratkit.callbacks.Backup`, `stratkit.callbacks.Throughput`, `stratkit.callbacks.LinearScalingWarmup`.

`Backup(backup_dir, every=K)` gives your own `model.fit` (under `make_strategy()`)
what `Trainer.fit(backup_dir=..., backup_every=K)` does: step backups, a resume at
the step reached with the callbacks' state, and preemption notices (put it last
in `callbacks`). See `stratkit.training.checkpoint`.
"""

from __future__ import annotations

from stratkit.training.callbacks import LinearScalingWarmup, Throughput
from stratkit.training.checkpoint import Backup

__all__ = ["Backup", "LinearScalingWarmup", "Throughput"]
