"""A search whose service runs on the engine's driver: what SparkRunner and RayRunner (`tune=True`) share.

An engine that starts its tuners from a driver process (Spark's driver, Ray's
driver) hosts the search service there, beside its own bookkeeping, and hands
each tuner process its part (`stratkit.tuning.environment`):

1. `DriverSearch(tuners, engine=..., host=...)`: the service (no store yet:
   the first tuner to register names it, with the planner), listening on
   `host` with a fresh token; `task_env(tuner, advertise=...)` is what one
   tuner process gets (the address the tuners reach the driver at may differ
   from the one it binds: Spark's `spark.driver.host` vs `bindAddress`);
2. while the tuners run, `judge(code)` says what a tuner's end means:
   `"ok"` (it returned), `"lost"` (it died after the search started: its
   lease expires and its trial runs again on another tuner, so the run goes
   on) or `"failed"` (it died before the start: a configuration problem, the
   run's failure); `check()` raises the search's own failure (a ConfigError:
   the same on every tuner, e.g. a build function that fails on the first
   hyperparameters);
3. at the end, `outcome(returned)`: the lowest tuner's return value when the
   search ended, else `None` with why (every tuner was lost before the end).

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
from stratkit.tuning.service import SearchService

log = status.logger(__name__)


class DriverSearch:
    """The search service of one engine run, hosted in this process (see the module's docstring).

    Args:
        tuners: how many tuners the search waits for before its first trial.
        engine: who started the tuners, for their messages ("SparkRunner(tune=True)").
        host: the address the service listens on (loopback unless the tuners run on other machines).
        environ: where STRATKIT_TUNE_LEASE_SECONDS / STRATKIT_TUNE_START_SECONDS are read (default: os.environ).

    Raises:
        ConfigError: the service cannot listen on `host`, or a variable is malformed.
    """

    def __init__(self, tuners: int, *, engine: str, host: str = environment.DEFAULT_HOST,
                 environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.tuners = tuners
        self.engine = engine
        self.markers = tempfile.mkdtemp(prefix="stratkit-tune-")
        self.token = environment.new_token()
        self.service = SearchService(
            None, tuners=tuners, markers=self.markers,
            lease_seconds=environment.seconds(environment.LEASE_VAR, environment.LEASE_SECONDS, env),
            start_seconds=environment.seconds(environment.START_VAR, environment.START_SECONDS, env))
        try:
            self.address = self.service.listen(host, 0, self.token)
        except OSError as exc:
            self.close()
            raise ConfigError(f"{engine}: the search service cannot listen on {host!r} ({exc.strerror or exc}). "
                              f"Fix: set {environment.HOST_VAR} to an address of this machine the tuners reach"
                              ) from None

    def task_env(self, tuner: int, advertise: str | None = None) -> dict[str, str]:
        """The variables tuner `tuner` gets; `advertise`: the host the tuners dial (default: the bound one)."""
        return environment.task_env((advertise or self.address[0], self.address[1]), self.token, tuner,
                                    self.tuners, engine=self.engine)

    @property
    def started(self) -> bool:
        """Whether the search handed out its first trial (every tuner registered, the store checked)."""
        return environment.started(self.markers)

    @property
    def ended(self) -> bool:
        """Whether the search ended (its last trial reported) or failed."""
        return self.service.done or self.service.failure is not None

    def judge(self, code: int | None) -> str:
        """What a tuner's end means to the run: "ok", "lost" (after the start) or "failed" (before it)."""
        if code == 0:
            return "ok"
        return "lost" if self.started and self.service.failure is None else "failed"

    def check(self) -> None:
        """Raise the search's own failure, if it had one (the error every tuner raised too).

        Raises:
            ConfigError: a tuner found the search cannot work (its store, its build function, another search).
            SearchFailed: the planner itself failed.
        """
        failure = self.service.failure
        if failure is None:
            return
        kind, message = failure
        protocol.raise_for({"error": message, "kind": kind})

    def wait(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) for the search to end; whether it did."""
        return self.service.wait_done(timeout)

    def outcome(self, returned: Mapping[int, Any]) -> tuple[bool, Any]:
        """(the search ended, the lowest tuner's return value), from each tuner that returned; raises `check`'s
        failure first."""
        self.check()
        if not self.service.done:
            return False, None
        if not returned:
            return True, None
        return True, returned[min(returned)]

    def close(self) -> None:
        """Stop the service (its state is on the store), log what a tracked search queued (bounded: MLflow,
        `stratkit.tuning.tracked`), remove the markers."""
        service = getattr(self, "service", None)
        if service is not None:
            service.close()
            close = getattr(service.planner, "close", None)
            if close is not None:
                close(error=service.failure[1] if service.failure is not None else None)
        shutil.rmtree(self.markers, ignore_errors=True)


def lost_message(label: str, how: str) -> str:
    """What an engine says when a tuner dies after the search started."""
    return (f"{label} {how}: the search goes on without it (its trial's lease expires and the trial runs again on "
            "another tuner)")


__all__ = ["DriverSearch", "lost_message"]
