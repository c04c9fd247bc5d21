"""An Optuna study as the search service's planner: the study itself lives where the service runs.

`OptunaPlanner` owns the search's one `optuna.Study`: an in-memory storage on
the chief or driver (no database to deploy), the user's sampler and pruner, and
the study's state in the store's ``search.json`` (trials, the sampler's random
state: `optuna_codec`), so a restarted service resumes the study. Tuners reach
it through the service (`stratkit.tuning.optuna_storage`): every storage call,
every sample and every pruning decision is made here, in one order.

What it decides:

* **the trials**: `propose` asks the study for its next trial (`Study.ask`: a
  waiting trial first, as Optuna pops its queue) and samples its parameters
  here and now, in the order the study's first trial suggested them (the
  "space", learned from that trial by its first report or its end), so the
  sampler draws in the order one process would. A tuner's objective then gets
  these values from its `suggest_*` calls; a parameter outside the plan (a
  conditional one, a range that changed) is sampled when the objective asks
  (`query("sample")`). A seeded RandomSampler, a GridSampler and TPE's random
  start therefore try one process's trials on N tuners; TPE past its start
  sees the trials finished so far, as Optuna's own parallel optimization does;
* **`n_trials`**: the trials of the whole study (not each tuner's), as
  `study.optimize(n_trials=...)` means in one process; a retried trial does
  not count again. `timeout` too is the study's: no trial starts after it;
* **a lost trial** (`lost`: its tuner died or hung, or the service restarted
  while it ran) is marked FAIL, as Optuna's heartbeat marks a stale trial,
  and a new trial with its parameters waits to run (Optuna's
  `RetryHeartbeatStaleTrialCallback`: `failed_trial`, `retry_history`), at most
  `retries` times;
* **pruning**: `query("prune")` runs the study's pruner on the trial as
  `Trial.should_prune` would (Median, Hyperband, ...);
* **the end**: `n_trials` trials proposed and none waiting to run again, the
  timeout, or `study.stop()` (from a tuner's objective or callback, or the
  sampler's own: GridSampler stops when its grid is done).

Imports Optuna.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import InMemoryStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from stratkit.tuning import optuna_codec as codec
from stratkit.tuning.planner import DONE, Proposal, trial_seed

#: A system attribute a lost trial gets: why stratkit marked it failed.
LOST_ATTR = "stratkit_lost"
#: A system attribute a failed trial gets from its tuner: the objective's error, as Optuna's optimize logs it.
ERROR_ATTR = "stratkit_error"
#: A tracked study's metric per reported step (`trial.report(value, step)`: Optuna's intermediate values).
INTERMEDIATE = "intermediate_value"
#: How a finished trial's state reads in MLflow (`stratkit.tuning.tracked`).
OUTCOMES = {TrialState.COMPLETE: "finished", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}


class _PlanStorage(InMemoryStorage):
    """The study's in-memory storage; while `planning`, a trial's parameters are sampled but not written (the
    tuner that runs the trial writes the ones its objective suggests). A trial read from it is a copy: Optuna's
    `Trial` adds each suggested parameter to the trial it read, which InMemoryStorage hands out as its own."""

    planning = False

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return copy.deepcopy(super().get_trial(trial_id))

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: Any) -> None:
        if not self.planning:
            super().set_trial_param(trial_id, param_name, param_value_internal, distribution)


class _ServiceStudy(optuna.Study):
    """The study as the service holds it: `stop()` (a sampler's, a tuner's) ends the search, not a loop here."""

    planner: OptunaPlanner

    def stop(self) -> None:
        self.planner.stopped = True


def suggest(trial: optuna.Trial, name: str, distribution: Any) -> Any:
    """`trial.suggest_*` for `distribution` (public calls: Optuna's own order of relative, fixed and
    independent sampling, its Hyperband filtering); the value in its external representation."""
    if isinstance(distribution, FloatDistribution):
        return trial.suggest_float(name, distribution.low, distribution.high, step=distribution.step,
                                   log=distribution.log)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high, step=distribution.step,
                                 log=distribution.log)
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    raise TypeError(f"unknown distribution {distribution!r}")


def describe(obj: Any) -> dict[str, Any]:
    """A sampler's or pruner's class and simple settings, for the fingerprint (not its random state)."""
    simple = (bool, int, float, str, type(None))
    settings = {k: v for k, v in sorted(vars(obj).items()) if isinstance(v, simple)
                or (isinstance(v, (list, tuple)) and all(isinstance(x, simple) for x in v))}
    kind = type(obj)
    return codec.json_safe({"class": f"{kind.__module__}.{kind.__qualname__}", "settings": settings}, "a setting")


class OptunaPlanner:
    """The `stratkit.tuning.planner.Planner` of an Optuna study (see the module's docstring).

    Args:
        study: the user's study spec: name (`named`: the user gave it, else Optuna's, different in each
            process), directions, attributes, and its trials before the search (enqueued or added; JSON).
        sampler / pruner: the user's study's.
        n_trials: the study's trials (None: until `timeout` or `stop()`).
        timeout: seconds after which no trial starts (None: no bound).
        seed: each trial's tuner seeds Python, NumPy and Keras with `trial_seed(seed, trial)` (None: no seeding).
        retries: how often a lost trial runs again (Optuna's `max_retry`).
    """

    library = "optuna"

    def __init__(self, study: dict[str, Any], sampler: Any, pruner: Any, *, n_trials: int | None,
                 timeout: float | None, seed: int | None, retries: int) -> None:
        self.spec = study
        self.sampler = sampler
        self.pruner = pruner
        self.n_trials = n_trials
        self.timeout = timeout
        self.seed = seed
        self.retries = int(retries)
        #: Sample each trial's parameters when it is proposed (N tuners: one order); False (one process): when
        #: its objective suggests them, exactly as Optuna's own optimize does (conditional spaces too).
        self.plan_ahead = True
        self.stopped = False
        self.counted = 0
        self.space: list[list[str]] | None = None
        self.plans: dict[str, list[list[Any]]] = {}
        self.started: float | None = None
        self._storage: _PlanStorage | None = None
        self._study_id = 0
        self._study: _ServiceStudy | None = None
        self._trials: dict[str, optuna.Trial] = {}

    def __getstate__(self) -> dict[str, Any]:  # travels to a driver before it runs: the spec, not the study
        state = self.__dict__.copy()
        state.update(_storage=None, _study=None, _trials={})
        return state

    def fingerprint(self) -> dict[str, Any]:
        initial = [{k: v for k, v in t.items() if k not in ("start", "complete")} for t in self.spec["trials"]]
        name = self.spec["name"] if self.spec.get("named") else None  # Optuna's own names differ per process
        return codec.json_safe({"name": name, "directions": self.spec["directions"],
                                "sampler": describe(self.sampler), "pruner": describe(self.pruner),
                                "n_trials": self.n_trials, "timeout": self.timeout, "seed": self.seed,
                                "retries": self.retries, "initial": initial}, "the study's settings")

    # -- the study ---------------------------------------------------------------------------------
    @property
    def study(self) -> _ServiceStudy:
        if self._study is None:
            self._build({"study": self.spec, "trials": self.spec["trials"]})
        assert self._study is not None
        return self._study

    def _build(self, state: dict[str, Any]) -> None:
        """The study from a state (`state()`, or the spec before the search)."""
        info = state["study"]
        name = str(info["name"])  # the user's, or the one Optuna gave the first worker's study (Hyperband hashes it)
        storage = _PlanStorage()
        study_id = storage.create_new_study([StudyDirection(d) for d in info["directions"]], name)
        for key, value in (info.get("user_attrs") or {}).items():
            storage.set_study_user_attr(study_id, key, value)
        for key, value in (info.get("system_attrs") or {}).items():
            storage.set_study_system_attr(study_id, key, value)
        for data in state.get("trials") or []:
            storage.create_new_trial(study_id, template_trial=codec.trial_from_json(data))
        study = _ServiceStudy(name, storage, self.sampler, self.pruner)
        study.planner = self
        self._storage, self._study_id, self._study = storage, study_id, study

    @property
    def storage(self) -> _PlanStorage:
        self.study  # noqa: B018 - built on first use
        assert self._storage is not None
        return self._storage

    def _frozen(self, trial_id: str | int) -> FrozenTrial:
        return self.storage.get_trial(int(trial_id))

    def _over(self) -> bool:
        if self.stopped:
            return True
        return self.timeout is not None and self.started is not None and time.time() - self.started > self.timeout

    # -- the planner's calls (the service's lock is held) ---------------------------------------------
    def propose(self) -> Any:
        study = self.study
        if self.started is None:
            self.started = time.time()
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        retry = any("failed_trial" in t.system_attrs for t in waiting)
        if self._over() or (self.n_trials is not None and self.counted >= self.n_trials and not retry):
            return DONE
        trial = study.ask()
        frozen = self._frozen(trial.number)
        original = frozen.system_attrs.get("failed_trial")
        if original is None:
            self.counted += 1
        plan: list[list[Any]] = []
        fixed = frozen.system_attrs.get("fixed_params") or {}
        self.storage.planning = True
        try:
            for name, text in (self.space or []) if self.plan_ahead else []:
                if name in frozen.distributions or name in fixed:
                    continue  # the trial has it already (a retry's, an enqueued one's): the tuner reads it
                distribution = codec.dist_from_json(text)
                value = suggest(trial, name, distribution)
                plan.append([name, text, distribution.to_internal_repr(value)])
        finally:
            self.storage.planning = False
        key = str(trial.number)
        self._trials[key], self.plans[key] = trial, plan
        number = trial.number if original is None else int(original)
        return Proposal(key, {"trial": trial.number, "plan": plan},
                        trial_seed(self.seed, str(number)) if self.seed is not None else 0)

    def _learn_space(self, trial_id: str) -> None:
        """The order the first trial to report (or end) suggested its parameters in: every later plan's."""
        if self.space is None:
            frozen = self._frozen(trial_id)
            self.space = [[name, codec.dist_to_json(d)] for name, d in frozen.distributions.items()]

    def report(self, trial_id: str, data: dict[str, Any]) -> dict[str, Any]:
        self.storage.set_trial_intermediate_value(int(trial_id), int(data["step"]), float(data["value"]))
        self._learn_space(trial_id)
        return {}

    def finish(self, trial_id: str, data: dict[str, Any]) -> None:
        self._learn_space(trial_id)
        state = TrialState[str(data["state"])]
        values = data.get("values") if state == TrialState.COMPLETE else None
        self.study.tell(int(trial_id), values, state=None if values is not None else state, skip_if_finished=True)
        self._trials.pop(trial_id, None)
        self.plans.pop(trial_id, None)

    def _fail(self, trial_id: str, reason: str) -> FrozenTrial | None:
        """Mark a running trial FAIL (as Optuna's `fail_stale_trials`); the trial as it was, with its plan."""
        frozen = copy.deepcopy(self._frozen(trial_id))
        self._trials.pop(trial_id, None)
        plan = self.plans.pop(trial_id, [])
        if frozen.state != TrialState.RUNNING:
            return None
        storage = self.storage
        storage.set_trial_system_attr(int(trial_id), LOST_ATTR, reason)
        storage.set_trial_state_values(int(trial_id), TrialState.FAIL)
        for name, text, internal in plan:  # the retry gets every parameter the trial had, suggested or planned
            if name not in frozen.params:
                distribution = codec.dist_from_json(text)
                frozen.distributions = {**frozen.distributions, name: distribution}
                frozen.params = {**frozen.params, name: distribution.to_external_repr(internal)}
        return frozen

    def lost(self, trial_id: str, reason: str) -> bool:
        frozen = self._fail(trial_id, reason)
        if frozen is not None and self.retries > 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=self.retries)
            retry(self.study, frozen)
        return True

    def give_up(self, trial_id: str, reason: str) -> None:
        self._fail(trial_id, reason)

    def query(self, name: str, args: dict[str, Any]) -> Any:
        """"storage" (a storage call of a tuner's study), "sample", "prune", "stop"; {"ok": ...} or {"raise": ...}."""
        try:
            if name == "storage":
                return {"ok": self._storage_call(str(args["method"]), list(args.get("args") or []))}
            if name == "sample":
                return {"ok": self._sample(str(args["trial"]), str(args["param"]), str(args["dist"]))}
            if name == "prune":
                trial = self._frozen(args["trial"])
                return {"ok": bool(self.study.pruner.prune(self.study, copy.deepcopy(trial)))}
            if name == "stop":
                self.stopped = True
                return {"ok": None}
        except (LookupError, ValueError, TypeError, RuntimeError, optuna.exceptions.OptunaError) as exc:
            return {"raise": codec.error_to_json(exc)}
        raise ValueError(f"unknown query {name!r}")

    def _sample(self, trial_id: str, name: str, text: str) -> Any:
        """A parameter outside the trial's plan, sampled now (Optuna's order from here on)."""
        distribution = codec.dist_from_json(text)
        trial = self._trials.get(trial_id)
        if trial is None or (name in trial.distributions and trial.distributions[name] != distribution):
            trial = self._trials[trial_id] = optuna.Trial(self.study, int(trial_id))  # its written params only
        self.storage.planning = True
        try:
            return distribution.to_internal_repr(suggest(trial, name, distribution))
        finally:
            self.storage.planning = False

    def _storage_call(self, method: str, args: list[Any]) -> Any:
        storage, study_id = self.storage, self._study_id
        if method == "get_trial":
            return codec.trial_to_json(storage.get_trial(int(args[0])))
        if method == "get_all_trials":
            states = None if args[0] is None else tuple(TrialState[s] for s in args[0])
            return [codec.trial_to_json(t) for t in storage.get_all_trials(study_id, deepcopy=False, states=states)]
        if method == "get_study_attrs":
            return {"user": storage.get_study_user_attrs(study_id), "system": storage.get_study_system_attrs(study_id)}
        if method == "set_study_attr":
            kind, key, value = args
            (storage.set_study_user_attr if kind == "user" else storage.set_study_system_attr)(study_id, key, value)
            return None
        if method == "create_new_trial":
            template = codec.trial_from_json(args[0]) if args[0] is not None else None
            return storage.create_new_trial(study_id, template_trial=template)
        if method == "set_trial_param":
            trial_id, name, internal, text = args
            storage.set_trial_param(int(trial_id), str(name), internal, codec.dist_from_json(text))
            return None
        if method == "set_trial_attr":
            kind, trial_id, key, value = args
            setter = storage.set_trial_user_attr if kind == "user" else storage.set_trial_system_attr
            setter(int(trial_id), key, value)
            return None
        if method == "set_trial_intermediate_value":
            trial_id, step, value = args
            storage.set_trial_intermediate_value(int(trial_id), int(step), float(value))
            return None
        if method == "set_trial_state_values":
            trial_id, state, values = args
            return storage.set_trial_state_values(int(trial_id), TrialState[state], values)
        if method == "trial_id_of_number":
            return storage.get_trial_id_from_study_id_trial_number(study_id, int(args[0]))
        raise ValueError(f"unknown storage call {method!r}")

    # -- what a tracked study logs (`stratkit.tuning.tracked`) ------------------------------------------
    def trial_ids(self) -> list[str]:
        return [str(t.number) for t in self.storage.get_all_trials(self._study_id, deepcopy=False)]

    def trial_params(self, trial_id: str) -> dict[str, Any]:
        """The trial's parameters so far: its plan's, then each its objective suggested (a retry's, all)."""
        frozen = self._frozen(trial_id)
        params = {name: codec.dist_from_json(text).to_external_repr(internal)
                  for name, text, internal in self.plans.get(str(trial_id), [])}
        params.update(frozen.system_attrs.get("fixed_params") or {})
        params.update(frozen.params)
        return params

    def trial_metrics(self, trial_id: str, data: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
        """A report as a metric at its step: Optuna's intermediate value."""
        return (int(data["step"]), {INTERMEDIATE: float(data["value"])}) if "value" in data else None

    def trial_outcome(self, trial_id: str) -> tuple[str, str | None, float | None] | None:
        """(status, error, score) once the trial ended; score: its value (one objective)."""
        frozen = self._frozen(trial_id)
        outcome = OUTCOMES.get(frozen.state)
        if outcome is None:
            return None
        if frozen.state == TrialState.FAIL:
            return outcome, str(frozen.system_attrs.get(LOST_ATTR) or frozen.system_attrs.get(ERROR_ATTR)
                                or "the trial failed"), None
        return outcome, None, float(frozen.values[0]) if len(frozen.values or []) == 1 else None

    # -- the stored search --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The study's name, directions, attributes and trials (what every tuner's study holds after the end)."""
        storage, study_id = self.storage, self._study_id
        return {"study": {"name": self.spec["name"], "directions": list(self.spec["directions"]),
                          "user_attrs": storage.get_study_user_attrs(study_id),
                          "system_attrs": codec.json_safe(storage.get_study_system_attrs(study_id),
                                                          "the study's system attributes")},
                "trials": [codec.trial_to_json(t) for t in storage.get_all_trials(study_id, deepcopy=False)]}

    def state(self) -> dict[str, Any]:
        return {**self.summary(), "space": self.space, "counted": self.counted, "stopped": self.stopped,
                "started": self.started, "plans": self.plans, "random": codec.random_state(self.sampler)}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue the stored study: its trials, the sampler's random state, the plans of the trials that ran."""
        self._build(state)
        self.space = state.get("space")
        self.counted = int(state.get("counted") or 0)
        self.stopped = bool(state.get("stopped"))
        self.started = state.get("started")
        self.plans = {str(k): list(v) for k, v in (state.get("plans") or {}).items()}
        codec.set_random_state(self.sampler, state.get("random") or {})


__all__ = ["ERROR_ATTR", "INTERMEDIATE", "LOST_ATTR", "OptunaPlanner", "describe", "suggest"]
