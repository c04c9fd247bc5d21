"""What a tuner library brings to the search service: a `Planner`, the search algorithm behind the leases.

The service (`stratkit.tuning.service`) owns what every library shares: trials
handed out as leases with heartbeats, a lost lease's trial run again, the start
gate, the end of the search, its state on the store. What trial comes next, and
what a result means, is the library's: a `Planner` wraps its algorithm (the
KerasTuner oracle: `stratkit.tuning.kt_oracle`; Optuna's study: its own module).

How a library plugs in:

1. a `Planner` (below) over its algorithm, living where the service runs (the
   launcher's worker 0, or a driver): it must pickle (cloudpickle), because a
   tuner registers it with a service in another process (a driver that never
   built it);
2. a tuner-side adapter that takes the user's object, registers the planner
   through `stratkit.tuning.session.open_session`, and runs each trial the
   service hands out (`client.Lease`: `payload`, `seed`, `run`), reporting
   with `report`, ending with `end`, and stopping when the lease is lost;
3. an entry in `stratkit.tuning.ADAPTERS`, so `stratkit.tune(obj)` finds it.

A planner may also have `lost(trial_id, reason) -> bool`: the service calls it
when a trial's lease is lost (or was running when a restarted service resumed);
True means the planner runs the trial again its own way (Optuna's: the trial is
marked failed and a new one with its parameters waits, as Optuna's heartbeat
retry does), False that the service reruns the same proposal (the default).

Determinism is the planner's: `propose` returns `WAIT` while the next trial
would depend on results that one process would already have (Hyperband's next
round, Bayesian optimisation past its random start), so N tuners try the same
trials as one process. The service keeps handing out re-runs of lost trials
meanwhile, and the planner never learns a trial ran twice.

Imports no TensorFlow.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Proposal:
    """A new trial: its id (unique in the search), what a tuner needs to run it (JSON), its seed."""

    trial_id: str
    payload: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    # Equal by name: a planner pickled by value (defined in a script's __main__) brings its own copy.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Sentinel) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> str:
        return self.name  # pickled as the module's global of that name


#: `propose`'s answer when the next trial needs results still running (or the algorithm is busy).
WAIT: Any = _Sentinel("WAIT")
#: `propose`'s answer when the search has no trial left to start.
DONE: Any = _Sentinel("DONE")


class Planner(Protocol):
    """A tuner library's search algorithm as the service drives it; every method is called under the
    service's lock, never twice at once. Everything handed in or out is JSON-able."""

    #: The library's name ("keras_tuner", "optuna"), in messages and in the stored state.
    library: str
    #: The search's seed: every tuner derives its trials' seeds from it (`trial_seed`), whatever seed its own
    #: copy of the search drew.
    seed: int

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal on every tuner of one search (the space, the objective, the algorithm's
        settings; not a seed a process drew itself), compared at registration and against a stored search."""

    def propose(self) -> Proposal | Any:
        """The next trial, `WAIT`, or `DONE`."""

    def report(self, trial_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """An intermediate result of a running trial (a metric at a step); the reply goes to its tuner
        (e.g. {"prune": true})."""

    def finish(self, trial_id: str, data: dict[str, Any]) -> None:
        """The trial's end as its tuner reports it (completed, failed, ... and its results)."""

    def give_up(self, trial_id: str, reason: str) -> None:
        """The service stops running this trial (its leases were lost too often): end it as failed."""

    def query(self, name: str, args: dict[str, Any]) -> Any:
        """A read the tuners need (a trial's state, the best trials, the search space)."""

    def state(self) -> dict[str, Any]:
        """Everything needed to resume the search in a new process (JSON)."""

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of an earlier process; trials it had running are still running."""

    def summary(self) -> dict[str, Any]:
        """What a tuner gets when the search ends, to answer queries without the service (the results)."""


def check_library_version(library: str, text: str, floor: tuple[int, ...], tested: tuple[tuple[int, ...], ...],
                          supported: str, newer_pin: str, log: Any) -> None:
    """One rule for a tuner library's version range (each adapter's `check_version`): below `floor` refused,
    above the newest `tested` minor release a warning, since the adapter reads the library's internals.

    Args:
        library: the package's name as pip knows it ("keras-tuner", "optuna").
        text: its version string.
        floor: the oldest release the adapter runs on.
        tested: the releases the suite ran.
        supported: the range `stratkit[tune]` installs, for the fix ("keras-tuner>=1.4.8,<1.5").
        newer_pin: the pin the warning suggests ("keras-tuner<1.5").
        log: where the warning goes (the adapter's logger).

    Raises:
        ConfigError: `text` is below `floor`.
    """
    parts = tuple(int(p) for p in text.split(".")[:3] if p.isdigit())
    if parts < floor:
        raise ConfigError(f"{library} {text} is older than stratkit's tuning supports ({'.'.join(map(str, floor))}). "
                          f"Fix: pip install 'stratkit[tune]' ({supported})")
    if parts[:2] > max(tested)[:2]:
        log.warning("%s %s is newer than stratkit's tuning was tested on (%s): if a search misbehaves, "
                    "pip install '%s'", library, text, ", ".join(".".join(map(str, v)) for v in tested), newer_pin)


def trial_seed(search_seed: int | str | None, trial_id: str) -> int:
    """The seed one trial trains with: from the search's seed and the trial's id only, so it is the same
    whichever tuner runs the trial, however often, and in one process."""
    digest = hashlib.sha256(f"stratkit-trial:{search_seed}:{trial_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


__all__ = ["DONE", "WAIT", "Planner", "Proposal", "check_library_version", "trial_seed"]
