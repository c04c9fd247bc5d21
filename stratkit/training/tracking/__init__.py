"""One MLflow run for the whole cluster: the chief logs, the other workers log nothing, a resumed run continues it.

| module | job |
|---|---|
| `handoff` | the driver's run handed to the tasks in their environment (`hand_over`, `handed_run_id`); pure Python |
| `runs` | which run the chief logs into (explicit, handed over, active, kept in the backup, or new), what it logged |
| `params` | what the run records about the cluster (strategy, replicas, global batch, engine, versions) |
| `autolog` | MLflow's own autologging kept off while stratkit logs (it would make one run per worker) |
| `logger` | `MLflowLogger`, the Keras callback (`stratkit.callbacks.MLflowLogger`) |

Importing this package imports neither TensorFlow nor MLflow (the launchers read `handoff`).
"""

from __future__ import annotations

import importlib
from typing import Any

from stratkit.training.tracking.handoff import RUN_ID_VAR, hand_over, handed_run_id

__all__ = ["RUN_ID_VAR", "MLflowLogger", "hand_over", "handed_run_id"]


def __getattr__(name: str) -> Any:
    if name == "MLflowLogger":  # a Keras callback: Keras (and MLflow) load with it
        return importlib.import_module("stratkit.training.tracking.logger").MLflowLogger
    raise AttributeError(f"module 'stratkit.training.tracking' has no attribute {name!r}")
