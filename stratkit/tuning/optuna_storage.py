"""A tuner's Optuna study on the search service: its storage, sampler and pruner speak to the service's study.

A distributed study (`stratkit.tuning.optuna_study`) keeps Optuna's own
`Trial`, `tell` and the user's objective, and changes three things under them:

* `SearchStorage` is the study's storage. Outside a search it is the study's
  in-memory storage (the user's, before; the results, after); during a search
  every call goes to the study on the search service (`optuna_planner`), over
  the authenticated wire. The trial this tuner runs goes through its lease
  (`stratkit.tuning.client`): a report renews the lease, the trial's end is
  the lease's end, and once the lease is lost (another tuner runs the trial's
  retry now) a write about the trial raises `TrialLost`;
* `PlannedSampler` answers `suggest_*` with the values the service planned for
  the trial (the order one process would draw them in), and asks the service
  for a parameter outside the plan; it never samples here;
* `RemotePruner` asks the service's pruner (`Trial.should_prune`).

What the service stores before it answers (`write`): a change to the study,
and a trial's report and end. A running trial's parameters, attributes, draws
and pruning verdicts are stored with its next report or its end: a service
that dies before then leaves the trial to be lost and run again anyway.

Optuna's storage API is public (`optuna.storages.BaseStorage`); the study's
trials keep their numbers as ids (one study per storage, `optuna_codec`).

Imports Optuna.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, InMemoryStorage
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from stratkit.errors import StratkitError
from stratkit.tuning import optuna_codec as codec


class TrialLost(StratkitError, RuntimeError):
    """The service took this tuner's trial back (its lease was lost): the trial failed and its retry runs elsewhere."""


class SearchStorage(BaseStorage):
    """A distributed study's storage (see the module's docstring).

    Args:
        local: the study's in-memory storage (the user's own, until the search ends).
        study_id / name / directions: the study's, as its `optuna.Study` knows them.
    """

    def __init__(self, local: InMemoryStorage, study_id: int, name: str, directions: Sequence[StudyDirection]) -> None:
        self.local = local
        self.local_id = study_id
        self.name = name
        self.directions = list(directions)
        self.client: Any = None  # the search's client while a search runs
        self.lease: Any = None  # the lease of the trial this tuner runs
        self.reported = False  # whether that trial reported (the first trial's objective got past its start)

    # -- the search --------------------------------------------------------------------------------
    @property
    def remote(self) -> bool:
        return self.client is not None

    def _call(self, method: str, *args: Any, write: bool = False) -> Any:
        reply = self.client.query("storage", write=write, method=method, args=list(args))
        if "raise" in reply:
            codec.raise_error(reply["raise"])
        return reply.get("ok")

    def mine(self, trial_id: int) -> bool:
        """Whether `trial_id` is the trial this tuner runs (and raise TrialLost when its lease was lost)."""
        lease = self.lease
        if lease is None or int(lease.payload["trial"]) != trial_id:
            return False
        if lease.lost.is_set():
            raise TrialLost(f"trial {trial_id}: the search service took it back (its lease was lost)")
        return True

    def finished(self, summary: dict[str, Any]) -> None:
        """The search ended: from now on the study is the results, in memory here."""
        local = InMemoryStorage()
        study_id = local.create_new_study(self.directions, self.name)
        for key, value in (summary["study"].get("user_attrs") or {}).items():
            local.set_study_user_attr(study_id, key, value)
        for key, value in (summary["study"].get("system_attrs") or {}).items():
            local.set_study_system_attr(study_id, key, value)
        for data in summary["trials"]:
            local.create_new_trial(study_id, template_trial=codec.trial_from_json(data))
        self.local, self.local_id, self.client, self.lease = local, study_id, None, None

    # -- BaseStorage: the study ---------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        raise NotImplementedError("a distributed study's storage holds that study only")

    def delete_study(self, study_id: int) -> None:
        raise NotImplementedError("a distributed study's storage holds that study only")

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        if not self.remote:
            return self.local.set_study_user_attr(self.local_id, key, value)
        self._call("set_study_attr", "user", key, codec.json_safe(value, f"study user attribute {key!r}"), write=True)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        if not self.remote:
            return self.local.set_study_system_attr(self.local_id, key, value)
        self._call("set_study_attr", "system", key, codec.json_safe(value, f"study system attribute {key!r}"),
                   write=True)

    def get_study_id_from_name(self, study_name: str) -> int:
        if study_name != self.name:
            raise KeyError(f"no study named {study_name!r} (this storage holds {self.name!r})")
        return self.local_id

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.name

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return list(self.directions)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_attrs")["user"] if self.remote else self.local.get_study_user_attrs(self.local_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        if not self.remote:
            return self.local.get_study_system_attrs(self.local_id)
        return self._call("get_study_attrs")["system"]

    def get_all_studies(self) -> list[FrozenStudy]:
        return [FrozenStudy(self.name, None, self.get_study_user_attrs(self.local_id),
                            self.get_study_system_attrs(self.local_id), self.local_id, directions=self.directions)]

    # -- BaseStorage: trials ------------------------------------------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        if not self.remote:
            return self.local.create_new_trial(self.local_id, template_trial)
        template = codec.trial_to_json(template_trial) if template_trial is not None else None
        return int(self._call("create_new_trial", template, write=True))

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        if not self.remote:
            return self.local.set_trial_param(trial_id, param_name, param_value_internal, distribution)
        self._call("set_trial_param", trial_id, param_name, param_value_internal, codec.dist_to_json(distribution),
                   write=not self.mine(trial_id))

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        if not self.remote:
            return self.local.get_trial_id_from_study_id_trial_number(self.local_id, trial_number)
        return int(self._call("trial_id_of_number", trial_number))

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        if not self.remote:
            return self.local.set_trial_state_values(trial_id, state, values)
        if self.mine(trial_id) and state.is_finished():  # the trial's end: its lease's end
            data = {"state": state.name, "values": [float(v) for v in values] if values is not None else None}
            if not self.client.end(self.lease, data):
                raise TrialLost(f"trial {trial_id}: the search service took it back before its end")
            return True
        return bool(self._call("set_trial_state_values", trial_id, state.name,
                               list(values) if values is not None else None, write=True))

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        if not self.remote:
            return self.local.set_trial_intermediate_value(trial_id, step, intermediate_value)
        if not self.mine(trial_id):
            return self._call("set_trial_intermediate_value", trial_id, step, intermediate_value, write=True)
        if self.client.report(self.lease, {"step": int(step), "value": float(intermediate_value)}) is None:
            raise TrialLost(f"trial {trial_id}: the search service took it back")
        if not self.reported:
            self.reported = True
            self.client.built(self.lease)  # the first trial got past its start: the other trials may start

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self.remote:
            return self.local.set_trial_user_attr(trial_id, key, value)
        self._call("set_trial_attr", "user", trial_id, key, codec.json_safe(value, f"user attribute {key!r}"),
                   write=not self.mine(trial_id))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self.remote:
            return self.local.set_trial_system_attr(trial_id, key, value)
        self._call("set_trial_attr", "system", trial_id, key, codec.json_safe(value, f"system attribute {key!r}"),
                   write=not self.mine(trial_id))

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if not self.remote:
            return self.local.get_trial(trial_id)
        return codec.trial_from_json(self._call("get_trial", trial_id))

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        if not self.remote:
            return self.local.get_all_trials(self.local_id, deepcopy=deepcopy, states=states)
        names = None if states is None else [s.name for s in TrialState if s in states]
        return [codec.trial_from_json(t) for t in self._call("get_all_trials", names)]


class PlannedSampler(optuna.samplers.BaseSampler):
    """A tuner's sampler during a search: the service's planned values, else the service samples (see the
    module's docstring). Never samples here, so N tuners draw as one sampler does."""

    def __init__(self, storage: SearchStorage) -> None:
        self.storage = storage
        self.plan: dict[str, tuple[BaseDistribution, Any]] = {}

    def use(self, plan: list[list[Any]]) -> None:
        """The plan of the trial this tuner runs now ([name, distribution JSON, internal value], ...)."""
        self.plan = {name: (codec.dist_from_json(text), internal) for name, text, internal in plan}

    def infer_relative_search_space(self, study: Any, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}  # the service's sampler did its relative sampling when it planned the trial

    def sample_relative(self, study: Any, trial: FrozenTrial, search_space: dict[str, BaseDistribution]) -> dict:
        return {}

    def sample_independent(self, study: Any, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        planned = self.plan.get(param_name)
        if planned is not None and planned[0] == param_distribution:
            return param_distribution.to_external_repr(planned[1])
        self.storage.mine(trial.number)
        reply = self.storage.client.query("sample", trial=str(trial.number), param=param_name,
                                          dist=codec.dist_to_json(param_distribution))
        if "raise" in reply:
            codec.raise_error(reply["raise"])
        return param_distribution.to_external_repr(reply["ok"])


class RemotePruner(optuna.pruners.BasePruner):
    """A tuner's pruner during a search: the service's pruner decides, on the study there."""

    def __init__(self, storage: SearchStorage) -> None:
        self.storage = storage

    def prune(self, study: Any, trial: FrozenTrial) -> bool:
        self.storage.mine(trial.number)
        reply = self.storage.client.query("prune", trial=str(trial.number))
        if "raise" in reply:
            codec.raise_error(reply["raise"])
        return bool(reply["ok"])


__all__ = ["PlannedSampler", "RemotePruner", "SearchStorage", "TrialLost"]
