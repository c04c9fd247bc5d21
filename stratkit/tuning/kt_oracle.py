"""A KerasTuner oracle as the search service's planner: the trials it proposes, in one process's order.

`KerasTunerPlanner` drives the user's own oracle (RandomSearch's, Hyperband's,
BayesianOptimization's, GridSearch's, a subclass) through its public calls:
`create_trial` with an id of the service's own for each proposal (KerasTuner
keys running trials by tuner id; here every proposal is one), `update_trial`
for a report, `end_trial` for a trial's end, `get_state`/`set_state` with the
trials' own states for the stored search.

Determinism (`exact=True`, the default): a trial is proposed only when it is
the trial one process would propose, i.e. when it does not depend on results
still running. Which proposals do (`needs_results`):

* RandomSearch: none (its values come from the seed, in trial order);
* Hyperband: every one but the random trials of a bracket's first round (the
  next rounds are the best of the last one: they wait for all of it, as in one
  process);
* BayesianOptimization: every one from `num_initial_points` on (the Gaussian
  process fits the results);
* anything else (GridSearch, a subclass with its own `populate_space`): every
  one, to be safe.

With `exact=False` the oracle proposes as KerasTuner's own distributed mode
does (a round may start from the results so far): more trials at once, not
one process's search.

The private parts of KerasTuner read here (Hyperband's brackets) are named in
`PRIVATE`; a KerasTuner without them falls back to waiting (exact, slower).

Imports KerasTuner (and so Keras) on use.
"""

from __future__ import annotations

import json
from typing import Any

from stratkit import status
from stratkit.tuning.planner import DONE, WAIT, Proposal, trial_seed

#: KerasTuner internals this module reads (the version gate is `kt_tuner.check_version`).
PRIVATE = ("HyperbandOracle._brackets", "HyperbandOracle._get_size")

log = status.logger(__name__)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _objective(objective: Any) -> Any:
    """An objective as data: name and direction (each of a MultiObjective's)."""
    parts = getattr(objective, "objectives", None)
    if parts:
        return [_objective(part) for part in parts]
    return {"name": getattr(objective, "name", None), "direction": getattr(objective, "direction", None)}


def trial_from_state(state: dict[str, Any]) -> Any:
    """A KerasTuner `Trial` from its state, without touching Python's global `random`.

    `Trial.from_state` first makes a Trial with a generated id (`random.randint` on the process's one global
    generator), then overwrites the id. The search service answers other tuners in the chief tuner's process, in a
    thread of its own: a draw there, between the chief's `set_random_seed` and its model's last default seed (a
    Dropout's), gave that trial other weights than one process gives it, at random and mostly under load."""
    from keras_tuner.engine.trial import Trial

    trial = Trial(hyperparameters=None, trial_id=state["trial_id"])
    trial.set_state(state)
    return trial


def initial_points(oracle: Any) -> int:
    """BayesianOptimization's random start: its `num_initial_points`, else 3 per dimension (at least 3)."""
    return int(getattr(oracle, "num_initial_points", None) or max(3 * len(oracle.hyperparameters.space), 3))


def _hyperband_needs_results(oracle: Any) -> bool:
    """Whether Hyperband's next trial is not a random first-round one (see the module's docstring)."""
    incomplete = [b for b in oracle._brackets
                  if len(b["rounds"][-1]) != oracle._get_size(b["bracket_num"], len(b["rounds"]) - 1)]
    if not incomplete:
        return False  # a new bracket's random first trial, or the end
    first = incomplete[0]
    return len(first["rounds"][0]) >= oracle._get_size(first["bracket_num"], 0)


def needs_results(oracle: Any) -> bool:
    """Whether the oracle's next proposal may depend on trials still running."""
    from keras_tuner import oracles

    method = type(oracle).populate_space
    try:
        if method is oracles.RandomSearchOracle.populate_space:
            return False
        if method is oracles.HyperbandOracle.populate_space:
            return _hyperband_needs_results(oracle)
        if method is oracles.BayesianOptimizationOracle.populate_space:
            return len(oracle.trials) >= initial_points(oracle)
    except (AttributeError, KeyError, TypeError) as exc:  # a KerasTuner whose internals moved: wait, to be exact
        log.debug("cannot tell whether the next trial needs results (%s): waiting for them", exc)
    return True


class KerasTunerPlanner:
    """The `stratkit.tuning.planner.Planner` of a KerasTuner oracle (see the module's docstring).

    Args:
        oracle: the user's tuner's oracle (`tuner.oracle`).
        exact: propose as one process would (wait for results where they decide the next trial).
    """

    library = "keras_tuner"

    def __init__(self, oracle: Any, *, exact: bool = True) -> None:
        self.oracle = oracle
        self.exact = bool(exact)
        self.seed = int(oracle.seed)
        self._creates = 0

    def fingerprint(self) -> dict[str, Any]:
        oracle = self.oracle
        kind = type(oracle)
        settings = {name: getattr(oracle, name) for name in (
            "max_epochs", "factor", "hyperband_iterations", "num_initial_points", "alpha", "beta",
            "max_retries_per_trial", "max_consecutive_failed_trials", "allow_new_entries", "tune_new_entries")
            if hasattr(oracle, name)}
        return _json({"oracle": f"{kind.__module__}.{kind.__qualname__}", "objective": _objective(oracle.objective),
                      "max_trials": oracle.max_trials, "space": oracle.hyperparameters.get_config(),
                      "settings": settings, "exact": self.exact})

    def propose(self) -> Any:
        from keras_tuner.engine.trial import TrialStatus

        if self.exact and self.oracle.ongoing_trials and needs_results(self.oracle):
            return WAIT
        self._creates += 1
        trial = self.oracle.create_trial(f"stratkit-{self._creates}")
        if trial.status == TrialStatus.RUNNING:
            return Proposal(trial.trial_id, {"trial": _json(trial.get_state())}, trial_seed(self.seed, trial.trial_id))
        if trial.status == TrialStatus.STOPPED:
            return DONE
        return WAIT  # IDLE: the oracle waits for results

    def report(self, trial_id: str, data: dict[str, Any]) -> dict[str, Any]:
        trial = self.oracle.update_trial(trial_id, dict(data.get("metrics") or {}), step=data.get("step", 0))
        return {"status": trial.status}

    def finish(self, trial_id: str, data: dict[str, Any]) -> None:
        self.oracle.end_trial(trial_from_state(data["trial"]))

    def give_up(self, trial_id: str, reason: str) -> None:
        from keras_tuner.engine.trial import TrialStatus

        trial = trial_from_state(self.oracle.get_trial(trial_id).get_state())
        trial.status, trial.message = TrialStatus.FAILED, reason
        self.oracle.end_trial(trial)

    def query(self, name: str, args: dict[str, Any]) -> Any:
        oracle = self.oracle
        if name == "trial":
            return _json(oracle.get_trial(str(args["trial_id"])).get_state())
        if name == "best":
            return [_json(t.get_state()) for t in oracle.get_best_trials(int(args.get("num_trials", 1)))]
        if name == "trials":
            return {trial_id: _json(t.get_state()) for trial_id, t in oracle.trials.items()}
        if name == "space":
            return _json(oracle.get_space().get_config())
        if name == "update_space":
            from keras_tuner import HyperParameters

            oracle.update_space(HyperParameters.from_config(args["space"]))
            return None
        if name == "remaining":
            return oracle.remaining_trials()
        raise ValueError(f"unknown query {name!r}")

    def state(self) -> dict[str, Any]:
        return {"oracle": _json(self.oracle.get_state()), "creates": self._creates,
                "trials": [_json(t.get_state()) for t in self.oracle.trials.values()]}

    def restore(self, state: dict[str, Any]) -> None:
        self.oracle.trials = {}
        for item in state.get("trials") or []:
            trial = trial_from_state(item)
            self.oracle.trials[trial.trial_id] = trial
        if state.get("oracle"):
            self.oracle.set_state(state["oracle"])
        self._creates = int(state.get("creates") or 0)

    def summary(self) -> dict[str, Any]:
        return self.state()

    # -- what a tracked search logs (`stratkit.tuning.tracked`) ---------------------------------------
    def trial_ids(self) -> list[str]:
        return list(self.oracle.trials)

    def trial_params(self, trial_id: str) -> dict[str, Any]:
        """The trial's hyperparameters (Hyperband's own `tuner/...` values too: which bracket and round)."""
        return _json(self.oracle.trials[trial_id].hyperparameters.values)

    def trial_outcome(self, trial_id: str) -> tuple[str, str | None, float | None] | None:
        """("finished" | "failed", its error, its score) once the trial ended; None while it runs."""
        from keras_tuner.engine.trial import TrialStatus

        trial = self.oracle.trials.get(trial_id)
        if trial is None or trial.status in (TrialStatus.RUNNING, TrialStatus.IDLE):
            return None
        if trial.status == TrialStatus.COMPLETED:
            return "finished", None, None if trial.score is None else float(trial.score)
        return "failed", trial.message or f"KerasTuner ended the trial {trial.status}", None


__all__ = ["PRIVATE", "KerasTunerPlanner", "initial_points", "needs_results", "trial_from_state"]
