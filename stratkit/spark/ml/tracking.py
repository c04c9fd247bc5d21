"""`KerasEstimator.fit` and MLflow: the driver owns the run, the chief task logs into it.

`tracking="auto"` (the default) logs when the driver has an active MLflow run
(`with mlflow.start_run(): pipeline.fit(df)`); `"nested"` logs each fit into a
child run of the active one (what tuning wants: one run per trial); `"mlflow"`
always logs (a run of the fit's own when none is active); `"off"` never.
`"nested"` and `"mlflow"` need the `mlflow` extra.

Which run a fit logs into (`driver_run`, on the driver):

* `"auto"`: the driver's active run, if no stratkit training has logged into it
  yet (one `fit` in a notebook's run is that run); else a child run of it, so a
  second fit's epochs are never taken for the first's; a fit in a thread of
  Spark ML's tuning pool (the trials) a child run of the run around
  `tuning.fit(df)`, and the final refit (in the calling thread) that run itself;
  no active run: no logging;
* `"nested"`: a child run of the active run (a top-level run without one), for
  every fit: `CrossValidator` / `TrainValidationSplit` trials and the final
  refit each get their own, under the run around `tuning.fit(df)`;
* `"mlflow"`: as `"auto"`, and a new run, ended with the fit, when none is active.

The run travels to the tasks as `SparkRunner` hands every active run over
(`stratkit.training.tracking.hand_over`); on the workers `MLflowTracking`
gives `fit` a `stratkit.callbacks.MLflowLogger`, which logs on the chief only
(params, each epoch's metrics once, the model with its signature). Spark ML
runs tuning trials in the threads of a pool; MLflow's active run is per
thread, so a trial finds the run around `tuning.fit(df)` in the main thread's
stack (`_main_thread_run`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

from stratkit.errors import ConfigError

MODES = ("auto", "nested", "mlflow", "off")
#: The tag a run gets once a stratkit training logged into it (a second fit in it nests a run of its own).
TRAINED_TAG = "stratkit.trained"


class MLflowTracking:
    """Pickled to every training process: the Keras callbacks that log the fit (on the chief; none elsewhere).

    `params` are logged with the run's own (the estimator's `buildParams`: what a tuning trial tried).
    """

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self.params = dict(params or {})

    def callbacks(self, trainer: Any) -> list[Any]:
        from stratkit.training.tracking import MLflowLogger, handed_run_id

        if handed_run_id() is None:  # the driver decided not to log this fit
            return []
        return [MLflowLogger(is_chief=trainer.is_chief, params=self.params)]


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"tracking={mode!r} is not one of {list(MODES)}. Fix: 'auto' (log into the driver's active "
                          "MLflow run, if any), 'nested' (a child run per fit, for tuning), 'mlflow' (always log; "
                          "needs pip install \"stratkit[mlflow]\") or 'off'")
    return mode


def context(mode: str, params: dict[str, Any] | None = None) -> MLflowTracking | None:
    """What `fit` hands the workers: None when this fit cannot log (off, or auto without MLflow installed)."""
    if check_mode(mode) == "off":
        return None
    if importlib.util.find_spec("mlflow") is None:
        if mode != "auto":
            raise ConfigError(f"tracking={mode!r} needs MLflow, which is not installed. Fix: pip install "
                              "\"stratkit[mlflow]\" (on the driver and every executor), or tracking='auto'")
        return None
    return MLflowTracking(params)


@contextlib.contextmanager
def driver_run(mode: str) -> Iterator[str | None]:
    """On the driver, around the training: the run this fit logs into is the active one inside (its id), or None."""
    if context(mode) is None:
        yield None
        return
    import mlflow

    active = mlflow.active_run()
    parent = active.info.run_id if active is not None else _main_thread_run(mlflow)
    if parent is None and mode != "mlflow":
        yield None
        return
    if active is not None and mode != "nested" and TRAINED_TAG not in mlflow.get_run(parent).data.tags:
        yield parent                 # the driver's own run, and this thread's: SparkRunner hands it over
        mlflow.set_tag(TRAINED_TAG, "true")
        return
    experiment = mlflow.get_run(parent).info.experiment_id if parent is not None else None
    with mlflow.start_run(nested=active is not None, parent_run_id=None if active is not None else parent,
                          experiment_id=experiment) as run:
        yield run.info.run_id        # active in this thread for the training: SparkRunner hands it over
        mlflow.set_tag(TRAINED_TAG, "true")


def _main_thread_run(mlflow: Any) -> str | None:
    """The run active in the driver's main thread, seen from another thread (None if none, or unknown).

    Spark ML's `CrossValidator`/`TrainValidationSplit` fit each trial in a thread of a pool, where MLflow has no
    active run (it keeps one per thread): the run around `tuning.fit(df)` is the main thread's. MLflow keeps every
    thread's stack in `_active_run_stack` (a `ThreadLocalVariable` with `get_all_thread_values`, MLflow 2.x-3.x);
    a MLflow without it gives None, and a trial in a thread then logs only with tracking="mlflow".
    """
    if threading.current_thread() is threading.main_thread():
        return None
    try:
        from mlflow.tracking import fluent

        stacks = fluent._active_run_stack.get_all_thread_values()
        stack = stacks.get(threading.main_thread().ident) or []
        return stack[-1].info.run_id if stack else None
    except Exception:  # noqa: BLE001 - an MLflow whose internals moved: no parent found
        return None
