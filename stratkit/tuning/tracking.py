"""A search in MLflow: one parent run for the search, one child run per trial, logged by the search service.

The service sees every trial's start, end and status, and the tuners send it
each epoch's metrics (an epoch report), so it is the one writer: the tuners
need no MLflow (Spark executors, Ray workers), a trial that ran on two tuners
is one child run, and nothing is logged twice:

* the parent run, when the first tuner registers: the run the engine's driver
  handed over (`with mlflow.start_run(): runner.run(...)`), or the one active
  in a one-process search; else (`tracking="mlflow"`) a new run, kept in the
  search's state (a resumed search continues it) and found again by its tag
  `stratkit.search`;
* a child run per trial, when it is first handed out, tagged
  `mlflow.parentRunId` and `stratkit.trial`: a trial that runs again, or a
  resumed search, finds its child on the server before it would make one;
* its hyperparameters, with the child (params the run has are not logged again);
* each epoch's metrics, as the tuner reports the epoch (step: the epoch): a
  (metric, step) the run holds is skipped (a run that takes over a lost trial
  re-trains only the epochs after its backup, one without a backup all of them);
* its status, when the trial ends: FINISHED; a pruned trial KILLED with tag
  `stratkit.trial_status=pruned`; a failed one (its error, or its tuner lost
  too often) FAILED with tag `stratkit.error`; a resumed search ends a trial
  whose end was not logged yet;
* the parent's end, when the search ends: FINISHED (FAILED with the search's
  error) when the search made the run; a handed-over run is its owner's.

How a tuner library's search gets here: `stratkit.tuning.tracked`.

MLflow calls run in a thread of their own, in order: a slow or absent
tracking server never holds a lease or a reply (a failed call is logged as a
warning); `close` logs what is queued, for a bounded time. A call stays in
`state()` (its journal, "pending") until MLflow took it, and the service
stores that state before it replies to the tuner: a search whose host dies
with calls still queued (an epoch's metrics a tuner was told were taken)
makes them again when it resumes. Every call is idempotent (what the run
holds is skipped), so a call made before the death is not logged twice.

Imports MLflow in that thread, no TensorFlow.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.training.tracking import handoff, runs

log = status.logger(__name__)

MODES = ("auto", "mlflow", "off")
TRIAL_TAG = "stratkit.trial"
SEARCH_TAG = "stratkit.search"
STATUS_TAG = "stratkit.trial_status"
ERROR_TAG = "stratkit.error"
#: MLflow's own tag that nests a run under its parent.
PARENT_TAG = "mlflow.parentRunId"
#: Seconds `close` waits for the queued calls (a tracking server that went away must not hold the search's end).
FLUSH_SECONDS = 60.0
#: MLflow's run status per trial status.
STATUSES = {"finished": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}
#: The calls a journal may hold (a stored state names nothing else).
CALLS = ("_start", "_log_params", "_metrics", "_end", "_finish")


@dataclass(frozen=True)
class TrackingOptions:
    """Where a search logs (decided by the tuner that registers first, from its environment: `options`)."""

    tracking_uri: str
    parent: str | None = None  # an existing run to nest the trials under (handed over, or active)
    experiment_id: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    params: dict[str, str] = field(default_factory=dict)  # the search's own, logged on a parent it made


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"tracking={mode!r} is not one of {list(MODES)}. Fix: 'auto' (the trials as child runs of "
                          "the MLflow run the engine handed over, or the active one, if any), 'mlflow' (always; a "
                          "new parent run when none) or 'off'")
    return mode


def options(mode: str, *, run_name: str | None = None, params: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> TrackingOptions | None:
    """The tracking a tuner's search asks for (`stratkit.tune(..., tracking=mode)`), or None (off).

    `auto`: the run the engine's driver handed over (`STRATKIT_MLFLOW_RUN_ID`, or MLflow's `MLFLOW_RUN_ID`)
    or the run active in this process, if any; `mlflow`: that, else a new run.

    Raises:
        ConfigError: a bad mode, `mlflow` without MLflow installed, a tracking server that does not answer, or an
            experiment (MLFLOW_EXPERIMENT_ID) it does not have.
    """
    import importlib.util
    import sys

    env = os.environ if environ is None else environ
    if check_mode(mode) == "off":
        return None
    if importlib.util.find_spec("mlflow") is None:
        if mode == "auto":
            return None
        raise ConfigError("tracking='mlflow' needs MLflow, which is not installed. Fix: pip install "
                          "'stratkit[mlflow]' (where the search service runs), or tracking='auto'")
    parent = handoff.handed_run_id(env) or env.get(runs.MLFLOW_RUN_ID_VAR, "").strip() or None
    uri = env.get(handoff.TRACKING_URI_VAR, "").strip()
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        active = mlflow.active_run()
        parent = parent or (active.info.run_id if active is not None else None)
        uri = mlflow.get_tracking_uri() if parent is not None and not uri else uri
    if parent is None and mode == "auto":
        return None
    if not uri:
        import mlflow as imported

        uri = imported.get_tracking_uri()
    uri = handoff.absolute_uri(uri)
    runs.probe(uri)  # an unreachable tracking server: a ConfigError here, before any trial
    experiment = handoff.handed_experiment(env)
    name = env.get(runs.EXPERIMENT_NAME_VAR, "").strip() or None
    if parent is None and experiment is not None:  # an experiment the server lacks: no run of the search is made
        import mlflow as imported

        runs.check_experiment(imported.MlflowClient(uri), experiment, name, uri)
    return TrackingOptions(tracking_uri=uri, parent=parent, experiment_id=experiment, experiment_name=name,
                           run_name=run_name, params={str(k): str(v)[:500] for k, v in (params or {}).items()})


class SearchTracking:
    """The MLflow runs of one search (see the module's docstring); the service calls it under its lock.

    Args:
        opts: where to log.
        key: the search's identity (its store), for the tag that finds a parent this search made.
        state: what `state()` returned before a restart (the parent, the trials' children, the ended ones).
    """

    def __init__(self, opts: TrackingOptions, key: str, state: Mapping[str, Any] | None = None) -> None:
        self.opts = opts
        self.key = hashlib.sha256(key.encode()).hexdigest()[:16]
        state = dict(state or {})
        self.parent: str | None = state.get("parent") or opts.parent
        self.owned = bool(state.get("owned", self.parent is None))
        self.children: dict[str, str] = {str(k): str(v) for k, v in (state.get("children") or {}).items()}
        self.ended: set[str] = set(state.get("ended") or [])
        self._pending: dict[int, list[Any]] = {}  # the journal: seq -> [call, args] not yet taken by MLflow
        self._seq = 0
        self._failed = 0  # calls MLflow refused three times
        self._logged: dict[str, dict[str, set[int]]] = {}
        self._params: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self._client: Any = None
        self._thread = threading.Thread(target=self._run, name="stratkit-search-mlflow", daemon=True)
        self._thread.start()
        for name, args in state.get("pending") or []:  # what a search that died had not logged yet
            if name in CALLS:
                self._put(name, tuple(args))

    # -- what the service tells it (cheap: queued) -------------------------------------------------
    def trial_started(self, trial_id: str, run: int, params: Mapping[str, Any]) -> None:
        self._put("_start", (str(trial_id), int(run), {str(k): str(v)[:500] for k, v in params.items()}))

    def trial_params(self, trial_id: str, params: Mapping[str, Any]) -> None:
        """Hyperparameters a trial got after its start (Optuna's suggested ones): the ones its run lacks."""
        self._put("_log_params", (str(trial_id), {str(k): str(v)[:500] for k, v in params.items()}))

    def trial_metrics(self, trial_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {}
        for key, value in metrics.items():
            try:
                numbers[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
        self._put("_metrics", (str(trial_id), int(step), numbers))

    def trial_ended(self, trial_id: str, outcome: tuple[str, str | None, float | None]) -> None:
        state, message, score = outcome
        self._put("_end", (str(trial_id), str(state), message, None if score is None else float(score)))

    def search_ended(self, error: str | None = None) -> None:
        self._put("_finish", (error,))

    def _put(self, name: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._pending[seq] = [name, list(args)]
        self._queue.put((seq, name, args))

    def state(self) -> dict[str, Any]:
        """JSON: what a restarted service continues from (with the calls MLflow has not taken yet)."""
        with self._lock:
            return {"parent": self.parent, "owned": self.owned, "children": dict(self.children),
                    "ended": sorted(self.ended), "pending": [self._pending[seq] for seq in sorted(self._pending)]}

    def close(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Log what is queued (at most `timeout` s), then stop; whether everything was logged."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._failed > 1:
            log.warning("MLflow: %d calls of this search could not be logged (the first one's error is above)",
                        self._failed)
        return not self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            seq, name, args = item
            for attempt in range(3):
                try:
                    getattr(self, name)(*args)
                    with self._lock:
                        self._pending.pop(seq, None)
                    break
                except Exception as exc:  # noqa: BLE001 - tracking never stops a search; said, then retried
                    if attempt == 2:  # stays in the journal: a resumed search tries it again
                        self._failed += 1
                        if self._failed == 1:  # said once; `close` counts the rest
                            log.warning("MLflow: could not log %s for %s: %s: %s", name.strip("_"), args[0] if args
                                        else "the search", type(exc).__name__, exc)
                    else:
                        time.sleep(0.5 * (attempt + 1))

    @property
    def client(self) -> Any:
        if self._client is None:
            # MLflow prints "View run <url>" as each run ends: a line per trial in the host tuner's output
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
            import mlflow

            self._client = mlflow.MlflowClient(self.opts.tracking_uri)
        return self._client

    def _experiment(self) -> str:
        if self.opts.experiment_id:
            return self.opts.experiment_id
        if self.parent is not None:
            return self.client.get_run(self.parent).info.experiment_id
        return runs.experiment_id(self.client, self.opts.experiment_name, {})

    def _parent(self) -> str:
        """The parent run: the one given or kept, else this search's own found by its tag, else a new one."""
        if self.parent is not None:
            return self.parent
        experiment = self._experiment()
        found = self.client.search_runs([experiment], filter_string=f"tags.`{SEARCH_TAG}` = '{self.key}'",
                                        max_results=1)
        if found:
            parent = found[0].info.run_id
        else:
            from mlflow.entities import Param

            run = self.client.create_run(experiment, run_name=self.opts.run_name, tags={SEARCH_TAG: self.key})
            parent = run.info.run_id
            if self.opts.params:
                self.client.log_batch(parent, params=[Param(k, v) for k, v in self.opts.params.items()])
        with self._lock:
            self.parent, self.owned = parent, True
        return parent

    def _child(self, trial_id: str) -> str:
        """The trial's child run: kept, else found on the server by its tags, else made."""
        with self._lock:
            known = self.children.get(trial_id)
        if known is not None:
            return known
        parent = self._parent()
        experiment = self.client.get_run(parent).info.experiment_id
        found = self.client.search_runs([experiment], filter_string=f"tags.`{PARENT_TAG}` = '{parent}' and "
                                        f"tags.`{TRIAL_TAG}` = '{trial_id}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            run_id = self.client.create_run(experiment, run_name=f"trial {trial_id}",
                                            tags={PARENT_TAG: parent, TRIAL_TAG: trial_id}).info.run_id
        with self._lock:
            self.children[trial_id] = run_id
        return run_id

    def _known(self, run_id: str) -> dict[str, set[int]]:
        """The (metric, steps) a run holds: read from the server once (a child made before a restart)."""
        if run_id not in self._logged:
            self._logged[run_id] = runs.logged_steps(self.client, run_id)
            self._params[run_id] = set(runs.logged_params(self.client, run_id))
        return self._logged[run_id]

    def _start(self, trial_id: str, run: int, params: dict[str, Any]) -> None:
        run_id = self._log_params(trial_id, params)
        self.client.set_tag(run_id, "stratkit.run", str(run))

    def _log_params(self, trial_id: str, params: dict[str, Any]) -> str:
        """Log the params the trial's run lacks (MLflow keeps a param's first value); the run's id."""
        from mlflow.entities import Param

        run_id = self._child(trial_id)
        self._known(run_id)
        new = [Param(str(k), str(v)[:500]) for k, v in params.items() if str(k) not in self._params[run_id]]
        if new:
            self.client.log_batch(run_id, params=new)
            self._params[run_id].update(p.key for p in new)
        return run_id

    def _metrics(self, trial_id: str, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        run_id = self._child(trial_id)
        logged = self._known(run_id)
        stamp = int(time.time() * 1000)
        new = [Metric(key, value, stamp, step) for key, value in metrics.items()  # (numbers: `trial_metrics`)
               if step not in logged.get(key, ())]
        if new:
            self.client.log_batch(run_id, metrics=new)
            for metric in new:
                logged.setdefault(metric.key, set()).add(step)

    def _end(self, trial_id: str, state: str, message: str | None, score: float | None) -> None:
        from mlflow.entities import Metric

        run_id = self._child(trial_id)
        tags = {STATUS_TAG: state}
        if message:
            tags[ERROR_TAG] = message[-4000:]
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)
        if score is not None and "score" not in self._known(run_id):
            self.client.log_batch(run_id, metrics=[Metric("score", float(score), int(time.time() * 1000), 0)])
        self.client.set_terminated(run_id, STATUSES.get(state, "FAILED"))
        with self._lock:
            self.ended.add(trial_id)

    def _finish(self, error: str | None) -> None:
        parent = self._parent()
        if error:
            self.client.set_tag(parent, ERROR_TAG, error[-4000:])
            with self._lock:
                running = [run_id for trial, run_id in self.children.items() if trial not in self.ended]
            for run_id in running:
                self.client.set_tag(run_id, ERROR_TAG, f"the search ended with an error: {error[-2000:]}")
                self.client.set_terminated(run_id, "FAILED")
        if self.owned:
            self.client.set_terminated(parent, "FAILED" if error else "FINISHED")


__all__ = ["FLUSH_SECONDS", "MODES", "SearchTracking", "TrackingOptions", "check_mode", "options"]
