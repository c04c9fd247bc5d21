"""The planner that feeds a search's MLflow runs (`stratkit.tuning.tracking`): what a tuner library's adapter
wraps its planner in when the search is tracked (`stratkit.tune(tuner, tracking=...)`).

    planner = TrackedPlanner(KerasTunerPlanner(oracle), tracking.options(mode), key=store_path)

The search service knows nothing of MLflow: it calls the wrapper as any
planner, in the process where the search runs, and the wrapper tells the runs
(`SearchTracking`, made there on first use, never in a tuner that only
registers) what happened: a trial proposed (its child run, its
hyperparameters), an epoch's metrics, a trial's end (its status), the search's
end. What the library's planner brings for it:

* `trial_params(trial_id)`: a trial's hyperparameters;
* `trial_outcome(trial_id)`: (status, message, score) once the trial ended
  (status "finished", "pruned" or "failed"), None while it runs;
* `trial_ids()`: every trial it knows (a resumed search ends in MLflow the
  trials whose end was not logged before the restart);
* optionally `trial_metrics(trial_id, data)`: a report the library's planner
  takes (Optuna's `trial.report`) as (step, metrics) to log, or None.

A trial's hyperparameters are logged when it is proposed, and the ones it got
later (Optuna's objective suggests them as it runs) with its reports and end.

Each epoch's metrics come from the adapter's tuners as a report
`epoch_report(epoch, logs)` (`client.report(lease, ...)`): the wrapper takes
it, the library's planner never sees it. Its state (the runs' ids, and the
calls MLflow has not taken yet) is stored with the planner's, in the search's
state on its store, so a resumed search continues its parent run and makes
the calls its last host had queued.

The queue of MLflow calls is flushed (bounded) when the engine closes the
search (`close`, `stratkit.tuning.driver`) or the process exits; a process
that exits before its search ended (the search failed) ends the parent run it
made as FAILED, and the trials still running with it.

Imports no MLflow (its runs do, in their thread), no TensorFlow.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from typing import Any

from stratkit.tuning.planner import Proposal
from stratkit.tuning.tracking import FLUSH_SECONDS, SearchTracking, TrackingOptions


def epoch_report(epoch: int, logs: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a tuner reports for one epoch of its trial (`client.report(lease, epoch_report(...))`)."""
    metrics = {}
    for key, value in (logs or {}).items():
        try:
            metrics[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return {"track": {"step": int(epoch), "metrics": metrics}}


class TrackedPlanner:
    """A library's planner whose search is logged to MLflow (see the module's docstring); pickles with it.

    Args:
        planner: the library's planner (it must have `trial_params` and `trial_outcome`).
        opts: where to log (`options`).
        key: the search's identity (its store's path).
    """

    def __init__(self, planner: Any, opts: TrackingOptions, key: str) -> None:
        self.planner = planner
        self.opts = opts
        self.key = key
        self._tracking: SearchTracking | None = None
        self._restored: dict[str, Any] | None = None
        self._ended = False
        self._sent: dict[str, set[str]] = {}  # the hyperparameters logged per trial (by name)

    def __getstate__(self) -> dict[str, Any]:
        return {"planner": self.planner, "opts": self.opts, "key": self.key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["planner"], state["opts"], state["key"])  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:  # the library's own attributes (library, seed, oracle, ...)
        if name.startswith("__") or name == "planner":
            raise AttributeError(name)
        return getattr(self.planner, name)

    @property
    def tracking(self) -> SearchTracking:
        """The runs, made on first use: in the process that runs the search, never in a tuner that only
        registers."""
        if self._tracking is None:
            self._tracking = SearchTracking(self.opts, self.key, self._restored)
            atexit.register(self._at_exit)
        return self._tracking

    @property
    def ended(self) -> bool:
        """Whether the search's end was told to MLflow (its summary taken, or closed with an error)."""
        return self._ended

    def fingerprint(self) -> dict[str, Any]:
        return self.planner.fingerprint()

    def propose(self) -> Any:
        proposal = self.planner.propose()
        if isinstance(proposal, Proposal):
            params = self.planner.trial_params(proposal.trial_id)
            self._sent[proposal.trial_id] = set(params)
            self.tracking.trial_started(proposal.trial_id, 1, params)
        return proposal

    def report(self, trial_id: str, data: dict[str, Any]) -> dict[str, Any]:
        track = data.get("track")
        if isinstance(track, dict):
            self.tracking.trial_metrics(trial_id, int(track.get("step", 0)), dict(track.get("metrics") or {}))
            return {}
        reply = self.planner.report(trial_id, data)
        as_metrics = getattr(self.planner, "trial_metrics", None)
        found = as_metrics(trial_id, data) if as_metrics is not None else None
        if found is not None:
            self._new_params(trial_id)
            self.tracking.trial_metrics(trial_id, *found)
        return reply

    def finish(self, trial_id: str, data: dict[str, Any]) -> None:
        self.planner.finish(trial_id, data)
        self._new_params(trial_id)
        self.tracking.trial_ended(trial_id, self.planner.trial_outcome(trial_id) or ("failed", None, None))

    def _new_params(self, trial_id: str) -> None:
        """Log the hyperparameters the trial got since they were last logged."""
        params = self.planner.trial_params(trial_id)
        sent = self._sent.setdefault(trial_id, set())
        if set(params) - sent:
            self.tracking.trial_params(trial_id, params)
            sent.update(params)

    def lost(self, trial_id: str, reason: str) -> bool:
        """A lost trial the library's planner reruns its own way (its optional `lost`: Optuna fails it and runs a
        new trial with its parameters) ends in MLflow as that planner ended it."""
        rerun = getattr(self.planner, "lost", None)
        if rerun is None or not rerun(trial_id, reason):
            return False
        outcome = self.planner.trial_outcome(trial_id)
        if outcome is not None:
            self._new_params(trial_id)
            self.tracking.trial_ended(trial_id, outcome)
        return True

    def give_up(self, trial_id: str, reason: str) -> None:
        self.planner.give_up(trial_id, reason)
        self.tracking.trial_ended(trial_id, ("failed", reason, None))

    def query(self, name: str, args: dict[str, Any]) -> Any:
        return self.planner.query(name, args)

    def state(self) -> dict[str, Any]:
        tracking = self._tracking.state() if self._tracking is not None else self._restored
        return {"tracked": self.planner.state(), "tracking": tracking}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue a stored search; a trial it ended whose end MLflow has not yet is ended there now."""
        if "tracked" not in state:  # a search stored without tracking
            self.planner.restore(state)
            return
        self.planner.restore(state.get("tracked") or {})
        self._restored = dict(state.get("tracking") or {})
        if self._restored.get("pending"):
            self.tracking  # noqa: B018 - made now: it makes the calls the search's last host had not made
        logged = set(self._restored.get("ended") or [])
        for trial_id in self.planner.trial_ids():
            if trial_id not in logged and (outcome := self.planner.trial_outcome(trial_id)) is not None:
                self.tracking.trial_ended(trial_id, outcome)

    def summary(self) -> dict[str, Any]:
        if not self._ended:
            self._ended = True
            self.tracking.search_ended(None)
        return self.planner.summary()

    def close(self, error: str | None = None, timeout: float = FLUSH_SECONDS) -> bool:
        """Log what is queued (an `error`: the search failed, its parent run too); whether all was logged."""
        if self._tracking is None:
            return True
        if error is not None and not self._ended:
            self._ended = True
            self.tracking.search_ended(error)
        done = self._tracking.close(timeout)
        atexit.unregister(self._at_exit)
        return done

    def _at_exit(self) -> None:
        self.close(None if self._ended else "the process hosting the search exited before the search ended")


__all__ = ["TrackedPlanner", "epoch_report"]
