"""MLflow's own autologging, kept off in a process where stratkit logs the run.

Why: `mlflow.keras.autolog()` / `mlflow.tensorflow.autolog()` replace
`keras.Model.fit` with a wrapper that starts a run when none is active and logs
every epoch through its own callback. On a cluster every worker runs `fit`, so
each one makes its own run (mlflow#11782), and a restarted worker makes yet
another; next to `MLflowLogger` the chief would log each epoch twice. The wrapper
decides when `fit` is called, before any callback runs, so the switch must be
thrown before: when the logger is made (it is an argument of that `fit`).

How: MLflow's `disable_autologging()` switch (`mlflow.utils.autologging_utils`),
entered once and kept for the life of the process: the wrapper then calls Keras's
`fit` untouched, whichever `autolog()` calls came before or come after. What
autologging would have recorded (params, per-epoch metrics, the model with its
signature) `MLflowLogger` records, once, in the one run.

Imports MLflow.
"""

from __future__ import annotations

import threading
from typing import Any

from stratkit import status

log = status.logger(__name__)

_lock = threading.Lock()
_switch: Any = None  # the entered disable_autologging() context


def switch_off(say: bool, late: bool = False) -> None:
    """Turn MLflow's autologging off in this process, for good (idempotent).

    Args:
        say: warn once when Keras or TensorFlow autologging was on (the chief says it; the others are quiet).
        late: the `fit` running now started after autologging was turned on (MLflow was imported after the
            logger was made): its autologging run, if any, exists already; said so.
    """
    global _switch
    from mlflow.utils import autologging_utils

    with _lock:
        if _switch is not None:
            return
        was_on = [flavor for flavor in ("keras", "tensorflow") if not autologging_utils.autologging_is_disabled(flavor)]
        _switch = autologging_utils.disable_autologging()
        _switch.__enter__()
    if was_on and late:
        log.warning("MLflow autologging (%s) was turned on after MLflowLogger was made: this fit's autologging "
                    "run could not be prevented on this worker. Fix: make the MLflowLogger after "
                    "mlflow.keras.autolog(), or do not turn autologging on", " and ".join(was_on))
    elif was_on and say:
        log.warning("MLflow autologging (%s) is off in the training processes: stratkit.callbacks.MLflowLogger "
                    "logs one run for the cluster (autologging would start one per worker and log each epoch "
                    "again)", " and ".join(f"mlflow.{f}.autolog" for f in was_on))


def is_off() -> bool:
    """True once `switch_off` ran in this process."""
    return _switch is not None
