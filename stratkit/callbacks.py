"""Public callbacks: `stratkit.callbacks.Backup`, `stratkit.callbacks.Throughput`, `stratkit.callbacks.LinearScalingWarmup`,
`stratkit.callbacks.MLflowLogger`.

`Backup(backup_dir, every=K)` gives your own `model.fit` (under `make_strategy()`)
what `Trainer.fit(backup_dir=..., backup_every=K)` does: step backups, a resume at
the step reached with the callbacks' state, and preemption notices (put it last
in `callbacks`). See `stratkit.training.checkpoint`.

`MLflowLogger()` logs the whole cluster's training to one MLflow run from the chief,
and a run resumed from a backup continues it (`stratkit.training.tracking`; MLflow is
the optional extra `stratkit[mlflow]`, imported when a logger is made).
"""

from __future__ import annotations

from stratkit.training.callbacks import LinearScalingWarmup, Throughput
from stratkit.training.checkpoint import Backup
from stratkit.training.tracking.logger import MLflowLogger

__all__ = ["Backup", "LinearScalingWarmup", "MLflowLogger", "Throughput"]

