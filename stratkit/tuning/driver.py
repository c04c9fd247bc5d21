"""The searches of an engine run hosted on its driver: what SparkRunner and RayRunner (`tune=True`) share.

An engine that starts its tuners from a driver process (Spark's driver, Ray's
driver) hosts the run's searches there, as `LocalRunner(tune=True)` does: one
listener for the run (`stratkit.tuning.hub.SearchHub`: the run's token), each
search made when its first tuner asks (its store and planner come with that
tuner's registration; a script may search several times). It hands each tuner
process its part (`stratkit.tuning.environment`):

1. `DriverSearch(tuners, engine=..., host=...)`: the hub listening on `host`
   with a fresh token; `task_env(tuner, advertise=...)` is what one tuner
   process gets (the address the tuners reach the driver at may differ from
   the one it binds: Spark's `spark.driver.host` vs `bindAddress`);
2. while the tuners run, `judge(code)` says what a tuner's end means:
   `"ok"` (it returned), `"lost"` (it died after a search started: its
   lease expires and its trial runs again on another tuner, so the run goes
   on) or `"failed"` (it died before any search started: a configuration
   problem, the run's failure); `check()` raises a search's own failure (a
   ConfigError: the same on every tuner, e.g. a build function that fails on
   the first hyperparameters);
3. at the end, `outcome(returned)`: the lowest tuner's return value when every
   search that started ended, else why not (every tuner was lost before).

The tuner ids an engine gives need not be 0..N-1: a tuner an engine starts
again (Spark retrying a lost task) gets a new id, so it never inherits a lease
its predecessor may still hold (`Leases.held_by`).

Imports no TensorFlow (the planner's library loads when the first tuner registers).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.tuning import environment, protocol
from stratkit.tuning.hub import SearchHub
from stratkit.tuning.service import SearchService

log = status.logger(__name__)


class DriverSearch:
    """The searches of one engine run, hosted in this process (see the module's docstring).

    Args:
        tuners: how many tuners each search waits for before its first trial.
        engine: who started the tuners, for their messages ("SparkRunner(tune=True)").
        host: the address the hub listens on (loopback unless the tuners run on other machines).
        environ: where STRATKIT_TUNE_LEASE_SECONDS / STRATKIT_TUNE_START_SECONDS are read (default: os.environ).

    Raises:
        ConfigError: the hub cannot listen on `host`, or a variable is malformed.
    """

    def __init__(self, tuners: int, *, engine: str, host: str = environment.DEFAULT_HOST,
                 environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.tuners = tuners
        self.engine = engine
        self.workdir = os.getcwd()  # where the tuners resolve a relative store (`environment.resolve`)
        lease = environment.seconds(environment.LEASE_VAR, environment.LEASE_SECONDS, env)
        start = environment.seconds(environment.START_VAR, environment.START_SECONDS, env)
        self.markers = tempfile.mkdtemp(prefix="stratkit-tune-")
        self.token = environment.new_token()
        self.services: list[SearchService] = []

        def create(search: int) -> SearchService:
            service = SearchService(None, tuners=tuners, lease_seconds=lease, start_seconds=start,
                                    markers=self.markers, search=search)
            self.services.append(service)
            return service

        try:
            self.hub = SearchHub(host, 0, self.token, tuners=tuners, create=create)
        except OSError as exc:
            shutil.rmtree(self.markers, ignore_errors=True)
            raise ConfigError(f"{engine}: the search service cannot listen on {host!r} ({exc.strerror or exc}). "
                              f"Fix: set {environment.HOST_VAR} to an address of this machine the tuners reach"
                              ) from None
        self.address = self.hub.address

    def task_env(self, tuner: int, advertise: str | None = None) -> dict[str, str]:
        """The variables tuner `tuner` gets; `advertise`: the host the tuners dial (default: the bound one)."""
        return environment.task_env((advertise or self.address[0], self.address[1]), self.token, tuner,
                                    self.tuners, engine=self.engine, workdir=self.workdir)

    @property
    def started(self) -> bool:
        """Whether a search handed out its first trial (every tuner registered, the store checked)."""
        return environment.started(self.markers)

    @property
    def ended(self) -> bool:
        """Whether every search that started ended, or a search failed."""
        return environment.ended(self.markers) or self._failure() is not None

    def _failure(self) -> tuple[str, str] | None:
        return next((s.failure for s in list(self.services) if s.failure is not None), None)

    def judge(self, code: int | None) -> str:
        """What a tuner's end means to the run: "ok", "lost" (after a search started) or "failed" (before)."""
        if code == 0:
            return "ok"
        return "lost" if self.started and self._failure() is None else "failed"

    def check(self) -> None:
        """Raise a search's own failure, if one had one (the error every tuner raised too).

        Raises:
            ConfigError: a tuner found a search cannot work (its store, its build function, another search).
            SearchFailed: a planner itself failed.
        """
        failure = self._failure()
        if failure is not None:
            protocol.raise_for({"error": failure[1], "kind": failure[0]})

    def outcome(self, returned: Mapping[int, Any]) -> tuple[bool, Any]:
        """(every search that started ended, the lowest tuner's return value), from each tuner that returned
        (`{tuner: value}`); raises `check`'s failure first."""
        self.check()
        if not environment.ended(self.markers):
            return False, None
        if not returned:
            return True, None
        return True, returned[min(returned)]

    def close(self) -> None:
        """Stop the hub and every search's lease clock (their states are on their stores), log what a tracked
        search queued (bounded: MLflow, `stratkit.tuning.tracked`), remove the markers."""
        self.hub.close()
        for service in list(self.services):
            close = getattr(service.planner, "close", None)
            if close is not None:
                close(error=service.failure[1] if service.failure is not None else None)
        shutil.rmtree(self.markers, ignore_errors=True)


def lost_message(label: str, how: str) -> str:
    """What an engine says when a tuner dies after the search started."""
    return (f"{label} {how}: the search goes on without it (its trial's lease expires and the trial runs again on "
            "another tuner)")


__all__ = ["DriverSearch", "lost_message"]
