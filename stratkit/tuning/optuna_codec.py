"""Optuna's objects as the search's JSON: trials, distributions, errors, and a sampler's random state.

Everything an Optuna study holds crosses the wire (`stratkit.tuning.protocol`)
and lives in the store's ``search.json`` as JSON, never as a pickle: a store is
data, and reading it back must not run code. What this module encodes:

* a trial (`optuna.trial.FrozenTrial`): its parameters in their internal
  representation with their distributions (`optuna.distributions`' own JSON),
  attributes, intermediate values, values, state, times. In every storage of a
  stratkit search a trial's id is its number (one study per storage);
* an error a storage or sampler call raised on the service, raised again in the
  tuner as the same Optuna exception (`UpdateFinishedTrialError`, ...);
* a sampler's random state: the NumPy generators reachable from the sampler's
  attributes (Optuna's `LazyRandomState`, a `RandomState`, a `Generator`), by
  attribute path, so a restarted service draws on where the last one stopped
  instead of from its seed again (a seeded RandomSampler would repeat the first
  trials). The walk reads attributes only through `vars()`; the sampler's
  other state lives in the trials (Optuna keeps it there for its distributed
  storages).

Imports Optuna (and NumPy).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, distribution_to_json, json_to_distribution
from optuna.trial import FrozenTrial, TrialState

#: The exceptions a storage or sampler call may raise that a tuner gets back as themselves (else RuntimeError).
ERRORS: dict[str, type[BaseException]] = {cls.__name__: cls for cls in (
    KeyError, ValueError, TypeError, RuntimeError, NotImplementedError,
    optuna.exceptions.UpdateFinishedTrialError, optuna.exceptions.DuplicatedStudyError,
    optuna.exceptions.StorageInternalError)}
#: How deep the random-state walk goes into a sampler's attributes (a sampler in a sampler in a strategy).
MAX_DEPTH = 4


def dist_to_json(distribution: BaseDistribution) -> str:
    return distribution_to_json(distribution)


def dist_from_json(text: str) -> BaseDistribution:
    return json_to_distribution(text)


def _time(value: datetime.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_time(text: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(text) if text else None


def json_safe(value: Any, what: str) -> Any:
    """`value` as JSON carries it; a TypeError naming `what` when it cannot be."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serializable for a distributed study (stratkit keeps the study as "
                        f"JSON on the search's store): {exc}. Fix: store a number, string, list or dict") from None


def trial_to_json(trial: FrozenTrial) -> dict[str, Any]:
    """One trial as JSON (its id is its number: see the module's docstring)."""
    distributions = trial.distributions
    return {
        "number": trial.number,
        "state": trial.state.name,
        "values": list(trial.values) if trial.values is not None else None,
        "start": _time(trial.datetime_start),
        "complete": _time(trial.datetime_complete),
        "params": {name: distributions[name].to_internal_repr(value) for name, value in trial.params.items()},
        "distributions": {name: dist_to_json(d) for name, d in distributions.items()},
        "user_attrs": json_safe(trial.user_attrs, f"trial {trial.number}'s user attributes"),
        "system_attrs": json_safe(dict(trial.system_attrs), f"trial {trial.number}'s system attributes"),
        "intermediate": {str(step): value for step, value in trial.intermediate_values.items()},
    }


def trial_from_json(data: dict[str, Any]) -> FrozenTrial:
    distributions = {name: dist_from_json(text) for name, text in (data.get("distributions") or {}).items()}
    values = data.get("values")
    return FrozenTrial(
        number=int(data["number"]), state=TrialState[str(data["state"])], value=None,
        values=[float(v) for v in values] if values is not None else None,
        datetime_start=_parse_time(data.get("start")), datetime_complete=_parse_time(data.get("complete")),
        params={name: distributions[name].to_external_repr(v) for name, v in (data.get("params") or {}).items()},
        distributions=distributions, user_attrs=dict(data.get("user_attrs") or {}),
        system_attrs=dict(data.get("system_attrs") or {}),
        intermediate_values={int(step): float(v) for step, v in (data.get("intermediate") or {}).items()},
        trial_id=int(data["number"]))


def error_to_json(exc: BaseException) -> dict[str, Any]:
    name = type(exc).__name__
    return {"type": name if name in ERRORS else "RuntimeError",
            "message": str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)}


def raise_error(data: dict[str, Any]) -> None:
    """Raise the error `error_to_json` encoded (the search service's, in this tuner)."""
    raise ERRORS.get(str(data.get("type")), RuntimeError)(str(data.get("message") or "error"))


# -- a sampler's random state ------------------------------------------------------------------
def _generators(obj: Any, path: str, seen: set[int], depth: int) -> list[tuple[str, Any]]:
    """(attribute path, generator) for every NumPy generator reachable from `obj` through Optuna objects."""
    if id(obj) in seen or depth > MAX_DEPTH or not hasattr(obj, "__dict__"):
        return []
    seen.add(id(obj))
    found: list[tuple[str, Any]] = []
    for name, value in sorted(vars(obj).items()):
        where = f"{path}.{name}" if path else name
        if isinstance(value, (np.random.RandomState, np.random.Generator)):
            found.append((where, value))
        elif type(value).__name__ == "LazyRandomState" and isinstance(getattr(value, "rng", None),
                                                                       np.random.RandomState):
            found.append((where, value.rng))  # created on first use: an unseeded one is random either way
        elif type(value).__module__.split(".")[0] == "optuna" and not isinstance(
                value, (optuna.Study, optuna.storages.BaseStorage)):
            found.extend(_generators(value, where, seen, depth + 1))
    return found


def random_state(sampler: Any) -> dict[str, Any]:
    """The states of the sampler's NumPy generators (JSON), by attribute path."""
    states: dict[str, Any] = {}
    for path, generator in _generators(sampler, "", set(), 0):
        if isinstance(generator, np.random.RandomState):
            kind, keys, pos, has_gauss, gauss = generator.get_state()
            states[path] = {"RandomState": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]}
        else:
            states[path] = {"Generator": json_safe(generator.bit_generator.state, "a generator's state")}
    return states


def set_random_state(sampler: Any, states: dict[str, Any]) -> int:
    """Put `random_state`'s states back into the sampler's generators at the same paths; how many were set."""
    done = 0
    for path, generator in _generators(sampler, "", set(), 0):
        state = states.get(path)
        if not isinstance(state, dict):
            continue
        if isinstance(generator, np.random.RandomState) and "RandomState" in state:
            kind, keys, pos, has_gauss, gauss = state["RandomState"]
            generator.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
            done += 1
        elif isinstance(generator, np.random.Generator) and "Generator" in state:
            generator.bit_generator.state = state["Generator"]
            done += 1
    return done


__all__ = ["ERRORS", "dist_from_json", "dist_to_json", "error_to_json", "json_safe", "raise_error", "random_state",
           "set_random_state", "trial_from_json", "trial_to_json"]
