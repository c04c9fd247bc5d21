"""The search service: the one place a distributed search is decided, on the chief or the driver.

It runs where the engine puts it (`stratkit launch --tune`: beside worker 0's
own tuner; `LocalRunner(tune=True)`: the driver; one process: the same
process) and answers every tuner's requests (`stratkit.tuning.protocol`),
which reach it through the run's listener (`stratkit.tuning.hub`: the run's
token; loopback unless the engine names the cluster's interface), or directly
in the process that hosts it. One service per search (a script may search
several times). What it decides:

* **the start**: no trial before every expected tuner registered (each proved
  it reaches the store and builds the same search: `register`), or
  `start_seconds` passed (then the missing ones are named and the search goes
  on without them); and no second trial before the first one's model built
  (a build function that fails on the first hyperparameters ends the search
  with a ConfigError on every tuner before anything trains);
* **trials as leases** (`stratkit.tuning.leases`): `next` hands a tuner a
  trial (a lost one's re-run first, else the planner's next proposal),
  heartbeats keep it, a dead or hung tuner's lease expires (`lease_seconds`),
  the trial runs again elsewhere; a stale run's messages are refused;
* **the order**: the planner proposes trials one at a time, in one order, and
  says `WAIT` where one process would have had a result first;
* **the end**: the planner is done and no trial runs or waits to run again:
  every tuner's next `next` answers "stop" with the results; a planner that
  waits while nothing runs (KerasTuner's Hyperband spinning on IDLE) ends the
  search too, with a warning. Every wait has a bound;
* **the state**: the store's ``search.json`` is replaced whole after every
  change, before the tuner that caused it gets its reply; a restarted service
  resumes from it (trials that were running run again; a finished one never).

Requests (`protocol`): register, next, beat, built, report, end, abort, query,
files. Each may be repeated after a lost connection and gets the same answer.

Size: one class whose lock and condition every request shares (the leases, the
gate, the end, the persisted state must change together); the lease table and
the store layout are modules of their own.

Imports no TensorFlow (the planner brings its library).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.tuning import environment, protocol
from stratkit.tuning.leases import Lease, Leases
from stratkit.tuning.planner import DONE, WAIT, Planner, Proposal
from stratkit.tuning.search_store import SearchStore

#: Seconds a `next` waits in the service for a trial before it answers "wait" (the tuner asks again).
WAIT_SLICE = 2.0
#: Seconds the host waits, after the end, for every tuner to hear it.
STOP_GRACE = 10.0
#: Version of search.json's layout.
STATE_VERSION = 1

log = status.logger(__name__)


class SearchService:
    """A search's trials, leases, start, end and stored state (see the module's docstring).

    Args:
        store: where the state lives; None: the first tuner to register names it (a driver that never saw the
            user's tuner, e.g. `LocalRunner`'s).
        tuners: how many tuners register before the first trial.
        lease_seconds: a lease's life without a heartbeat (tuners beat every lease_seconds / 6).
        start_seconds: how long the first trial waits for every tuner to register.
        markers: a local directory for the engine's `started-<search>` / `done-<search>` markers (or None).
        search: this search's number in its run (a script may search several times, `hub.SearchHub`).
    """

    def __init__(self, store: SearchStore | None, *, tuners: int = 1, lease_seconds: float = environment.LEASE_SECONDS,
                 start_seconds: float = environment.START_SECONDS, markers: str | None = None,
                 max_losses: int | None = None, search: int = 0) -> None:
        self.store = store
        self.tuners = max(1, int(tuners))
        self.lease_seconds = float(lease_seconds)
        self.heartbeat = max(0.05, self.lease_seconds / 6)
        self.markers = markers
        self.search = int(search)
        self.leases = Leases(self.lease_seconds, **({} if max_losses is None else {"max_losses": max_losses}))
        self.planner: Planner | None = None
        self.fingerprint: dict[str, Any] | None = None
        self.registered: set[int] = set()
        self.failure: tuple[str, str] | None = None  # (kind, message): the search ended with an error
        #: trial id -> the run whose result ended it (its files are the trial's).
        self.ended: dict[str, int] = {}
        self.done = False
        self._final: dict[str, Any] | None = None
        self._heard_stop: set[int] = set()
        self._handed = 0
        self._first: str | None = None  # the first trial, until its model built
        self._connections: dict[int, int] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._write_lock = threading.Lock()
        self._version = 0
        self._written = 0
        self._started_at = time.monotonic()
        self._start_deadline = self._started_at + float(start_seconds)
        self.nonce = store.write_handshake() if store is not None else None
        self._closing = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="stratkit-search-leases", daemon=True)
        self._ticker.start()

    # -- connections (counted by the hub that routes them: `stratkit.tuning.hub`) -------------------
    def connected(self, tuner: int) -> None:
        """A connection of `tuner` sent its first request to this search."""
        with self._lock:
            self._connections[tuner] = self._connections.get(tuner, 0) + 1

    def disconnected(self, tuner: int) -> None:
        """A connection of `tuner` closed; the last one: its lease lives only `leases.RECONNECT_GRACE` s more."""
        with self._lock:
            self._connections[tuner] = max(0, self._connections.get(tuner, 0) - 1)
            if self._connections[tuner] == 0:
                self.leases.disconnected(tuner, time.monotonic())
                self._changed.notify_all()

    # -- requests ---------------------------------------------------------------------------------
    def handle(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        """One request from `tuner` (over the wire or in-process): its reply ({"ok": ...} or an error)."""
        op = request.get("op")
        method = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if method is None:
            return {"error": f"unknown request {op!r}", "kind": "protocol"}
        try:
            return {"ok": method(tuner, request)}
        except _Refused as exc:
            return {"error": str(exc), "kind": exc.kind}
        except ConfigError as exc:  # e.g. the store a tuner named does not answer: the search cannot start
            self.fail("config", str(exc))
            return {"error": str(exc), "kind": "config"}
        except Exception as exc:  # noqa: BLE001 - the planner's own error ends the search, on every tuner
            message = f"the search failed in its {op!r}: {type(exc).__name__}: {exc}"
            log.error(message)
            self.fail("failed", message)
            return {"error": message, "kind": "failed"}

    def _check_failed(self) -> None:
        if self.failure is not None:
            raise _Refused(*self.failure)

    def _op_register(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        error = request.get("error")
        if error:
            self.fail("config", str(error))
        planner = request.get("planner_object")
        if planner is None and request.get("planner") is not None and self.planner is None:
            planner = _unpickle(request["planner"])  # outside the lock: it may import the library (and Keras)
        with self._lock:
            self._check_failed()
            fingerprint = json.loads(json.dumps(request.get("fingerprint") or {}))
            self._use_store(tuner, request.get("store"))
            if self.planner is None:
                if planner is None:
                    return {"need_planner": True}
                self._adopt(planner, fingerprint)
            elif fingerprint != self.fingerprint:
                self._fail_locked("config", _mismatch(tuner, fingerprint, self.fingerprint or {}))
                self._check_failed()
            self.registered.add(tuner)
            self._changed.notify_all()
            assert self.store is not None
            return {"nonce": self.nonce, "store": self.store.path, "heartbeat": self.heartbeat,
                    "lease_seconds": self.lease_seconds, "seed": getattr(self.planner, "seed", 0)}

    def register_planner(self, tuner: int, planner: Planner) -> dict[str, Any]:
        """Register an in-process tuner together with its planner (no pickling): the host's and one process's."""
        return protocol.raise_for(self.handle(tuner, {"op": "register", "planner_object": planner,
                                                      "fingerprint": planner.fingerprint()}))

    def _use_store(self, tuner: int, path: Any) -> None:
        """The store a registering tuner names: the search's when it has none yet, else it must be the same."""
        if path is None:
            if self.store is None:
                raise _Refused("protocol", "register: the first tuner must name the search's store")
            return
        named = SearchStore(str(path))
        if self.store is None:
            named.check()
            self.store, self.nonce = named, named.write_handshake()
        elif named.path != self.store.path:
            self._fail_locked("config", f"tuner {tuner} keeps the search in {named.shown!r}, the search service in "
                              f"{self.store.shown!r}. Fix: give every tuner the same store (the same directory and "
                              "project_name, or the same store= URL)")
            self._check_failed()

    def _adopt(self, planner: Planner, fingerprint: dict[str, Any]) -> None:
        """The first registered planner becomes the search's, resumed from the store when it holds this search."""
        assert self.store is not None
        state = self.store.read_state()
        if state is not None:
            if state.get("library") != planner.library or state.get("fingerprint") != fingerprint:
                self._fail_locked("config", f"{self.store.what}={self.store.shown!r} holds another search ("
                                  f"{_difference(fingerprint, state.get('fingerprint') or {})}). Fix: give this "
                                  "search its own store (or directory/project_name), or move the old one away")
                self._check_failed()
            planner.restore(state.get("planner") or {})
            self.leases.restore(state.get("leases") or {})
            self.leases.queue = [p for p in self.leases.queue if not self._planner_reruns(p.trial_id, "the search "
                                                                                          "service restarted", planner)]
            self.ended = {str(k): int(v) for k, v in (state.get("ended") or {}).items()}
            self._handed = int(state.get("handed") or 0)
            log.info("resumed the search from %s: %d trial(s) finished, %d to run again", self.store.shown,
                     len(self.ended), len(self.leases.queue))
        self.planner, self.fingerprint = planner, fingerprint
        self._version += 1

    def _gate(self, now: float) -> bool:
        """Whether trials may start: every tuner registered (or the start bound passed), the first one built."""
        if len(self.registered) < self.tuners:
            if now < self._start_deadline:
                return False
            if not self._handed:
                missing = sorted(set(range(self.tuners)) - self.registered)
                log.warning("the search starts with %d of %d tuners: tuner(s) %s did not register within %g s (%s)",
                            len(self.registered), self.tuners, ", ".join(map(str, missing)),
                            self._start_deadline - self._started_at, environment.START_VAR)
        if self._first is not None:
            return False
        return True

    def _op_next(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            deadline = time.monotonic() + min(WAIT_SLICE, float(request.get("wait", WAIT_SLICE)))
            while True:
                self._check_failed()
                if tuner not in self.registered:
                    raise _Refused("protocol", f"tuner {tuner} asked for a trial before it registered")
                held = self.leases.held_by(tuner)
                if held is not None:
                    return {"trial": held.to_message(self.heartbeat)}
                now = time.monotonic()
                lease = None
                if not self.done and self._gate(now):
                    lease = self._next_lease(tuner, now)
                if self.done:
                    self._heard_stop.add(tuner)
                    self._changed.notify_all()
                    reply, version = {"stop": self._final}, self._version
                    break
                if lease is not None:
                    reply, version = {"trial": lease.to_message(self.heartbeat)}, self._version
                    break
                if deadline - now <= 0:
                    return {"wait": True}
                self._changed.wait(min(deadline - now, 0.5))
        self._persist(version)
        return reply

    def _next_lease(self, tuner: int, now: float) -> Lease | None:
        """A re-run first, else the planner's next trial; ends the search when nothing is left (locked)."""
        proposal = self.leases.take()
        if proposal is None:
            proposal = self.planner.propose()  # type: ignore[union-attr]
            if not isinstance(proposal, Proposal):
                if not self.leases.busy():
                    if proposal == WAIT:
                        log.warning("the %s planner waits for results, but no trial runs: the search ends here "
                                    "(%d trial(s) finished)", self.planner.library, len(self.ended))  # type: ignore
                    elif proposal != DONE:
                        raise TypeError(f"the planner proposed {proposal!r}")
                    self._finish_locked()
                return None
        first = self._handed == 0
        self._handed += 1
        lease = self.leases.hand_out(proposal, tuner, now, first=first)
        if first:
            self._first = proposal.trial_id
            environment.mark(self.markers, environment.started_name(self.search))
        self._version += 1
        return lease

    def _finish_locked(self) -> None:
        self.done = True
        self._final = {"summary": self.planner.summary(), "ended": dict(self.ended)}  # type: ignore[union-attr]
        self._version += 1
        self._changed.notify_all()

    def _op_beat(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {"alive": self.leases.beat(str(request["trial"]), int(request["run"]), time.monotonic())}

    def _op_built(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        """The first trial's model built: the other trials may start."""
        with self._lock:
            if self._first == str(request["trial"]):
                self._first = None
                self._changed.notify_all()
            return {}

    def _op_report(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._check_failed()
            trial_id, run = str(request["trial"]), int(request["run"])
            if self.leases.current(trial_id, run) is None:
                return {"alive": False}
            self.leases.beat(trial_id, run, time.monotonic())
            reply = self._ask(lambda: self.planner.report(trial_id, dict(request.get("data") or {})))  # type: ignore
            self._version += 1
            version = self._version
        self._persist(version)
        return {"alive": True, "reply": reply}

    def _op_end(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        trial_id, run = str(request["trial"]), int(request["run"])
        with self._lock:
            if self.ended.get(trial_id) == run:
                return {"accepted": True}  # a repeated end (the reply was lost)
            self._check_failed()
            if self.leases.close(trial_id, run) is None:
                return {"accepted": False}
            if self._first == trial_id:
                self._first = None
            self.ended[trial_id] = run
            self.planner.finish(trial_id, dict(request.get("data") or {}))  # type: ignore[union-attr]
            self._version += 1
            version = self._version
            self._changed.notify_all()
        self._persist(version)
        return {"accepted": True}

    def _op_abort(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        """End the search for all: it cannot work ("config": the first trial fails), or a trial's error ends it."""
        kind = "failed" if request.get("kind") == "failed" else "config"
        self.fail(kind, str(request.get("error") or "a tuner ended the search"))
        return {}

    def _op_query(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        """A read of the planner's; `write`: a change it makes for a tuner (stored before the reply)."""
        write = bool(request.get("write"))
        with self._lock:
            if self.planner is None:
                raise _Refused("protocol", "no planner registered yet")
            planner = self.planner
            value = self._ask(lambda: planner.query(str(request["name"]), dict(request.get("args") or {})))
            self._version += write
            version = self._version if write else None
        self._persist(version)
        return {"value": value}

    @staticmethod
    def _ask(call: Any) -> Any:
        """A planner call whose error is its caller's alone (a report without the objective, an unknown trial):
        that tuner's request fails (its trial, as KerasTuner would have it), the search goes on."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - told to the one tuner that asked
            raise _Refused("request", f"{type(exc).__name__}: {exc}") from None

    def _op_files(self, tuner: int, request: dict[str, Any]) -> dict[str, Any]:
        """The run whose files are the trial's (the one that ended it), or None."""
        with self._lock:
            return {"run": self.ended.get(str(request["trial"]))}

    # -- failures, expiry, the end ------------------------------------------------------------------
    def fail(self, kind: str, message: str) -> None:
        """End the search with an error every tuner raises ("config": a ConfigError)."""
        with self._lock:
            self._fail_locked(kind, message)

    def _fail_locked(self, kind: str, message: str) -> None:
        if self.failure is None:
            self.failure = (kind, message)
            self._changed.notify_all()

    def _tick(self) -> None:
        """Expire leases; a pause of this process itself (SIGSTOP, a suspended VM) is not the tuners' fault."""
        step = min(0.2, self.heartbeat / 2)
        last = time.monotonic()
        while not self._closing.wait(step):
            now = time.monotonic()
            version = None
            with self._lock:
                if now - last > 5 * step + 1.0:
                    self.leases.shift(now - last)
                for lease in self.leases.expire(now):
                    version = self._lost(lease)
            last = now
            if version is not None:
                self._persist(version)

    def _lost(self, lease: Lease) -> int:
        """A lease expired: run the trial again (the planner's own way if it has one), or give it up (locked)."""
        if self._planner_reruns(lease.trial_id, f"its tuner was lost (no heartbeat for {self.lease_seconds:g} s)"):
            self._first = None if self._first == lease.trial_id else self._first  # its re-run is another trial
        elif self.leases.requeue(lease.proposal):
            log.warning("tuner %d lost trial %s (run %d: no heartbeat for %g s); it runs again on the next free "
                        "tuner", lease.tuner, lease.trial_id, lease.run, self.lease_seconds)
        else:
            reason = f"its tuner was lost {self.leases.max_losses} times (no heartbeat for {self.lease_seconds:g} s)"
            log.warning("trial %s failed: %s", lease.trial_id, reason)
            self.planner.give_up(lease.trial_id, reason)  # type: ignore[union-attr]
            if self._first == lease.trial_id:
                self._first = None
        self._version += 1
        self._changed.notify_all()
        return self._version

    def _planner_reruns(self, trial_id: str, reason: str, planner: Planner | None = None) -> bool:
        """Whether the planner reruns the lost trial its own way (its optional `lost`)."""
        return bool(getattr(planner or self.planner, "lost", lambda *_: False)(trial_id, reason))

    def _persist(self, version: int | None) -> None:
        """Write the state at `version` or later to the store (before the caller replies: a reply is durable)."""
        if version is None:
            return
        with self._write_lock:
            if self._written >= version:
                return
            with self._lock:
                if self.planner is None:
                    return
                current = self._version
                state = {"version": STATE_VERSION, "library": self.planner.library, "fingerprint": self.fingerprint,
                         "planner": self.planner.state(), "leases": self.leases.state(), "ended": self.ended,
                         "handed": self._handed, "done": self.done, "final": self._final}
            assert self.store is not None
            self.store.write_state(state)
            self._written = current
        if self.done:
            environment.mark(self.markers, environment.done_name(self.search))

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the search ended (or failed); False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self.done and self.failure is None:
                if end is not None and time.monotonic() >= end:
                    return False
                self._changed.wait(0.5)
            return True

    def wait_heard(self, timeout: float = STOP_GRACE) -> list[int]:
        """After the end, wait (at most `timeout` s) until every registered tuner heard it, or left; returns
        the tuners that did not (a hung one)."""
        end = time.monotonic() + timeout
        with self._lock:
            while True:
                missing = sorted(t for t in self.registered - self._heard_stop if self._connections.get(t, 0) > 0)
                if not missing or time.monotonic() >= end:
                    return missing
                self._changed.wait(0.2)

    def close(self) -> None:
        """Stop the lease clock (the state is already on the store)."""
        self._closing.set()
        with self._lock:
            self._changed.notify_all()


class _Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _unpickle(blob: Any) -> Planner:
    """A planner a tuner sent (cloudpickled, base64): the tuner authenticated with the run's token."""
    import cloudpickle

    if not isinstance(blob, str):
        raise _Refused("protocol", "register: the planner must be a base64 string")
    try:
        return cloudpickle.loads(base64.b64decode(blob))
    except Exception as exc:  # noqa: BLE001 - e.g. the tuner library is not installed where the service runs
        raise ConfigError(f"the search service cannot load the tuners' search ({type(exc).__name__}: {exc}). Fix: "
                          "install the tuner library (pip install 'stratkit[tune]') and the script's modules where "
                          "the service runs (the driver) too") from None


def _difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    shown = "; ".join(f"{k}: {str(mine.get(k))[:200]} vs {str(theirs.get(k))[:200]}" for k in keys[:3])
    return shown or "the same settings"


def _mismatch(tuner: int, fingerprint: dict[str, Any], search: dict[str, Any]) -> str:
    return (f"tuner {tuner} builds another search than the one the service runs ({_difference(fingerprint, search)}). "
            "Every tuner must run the same script with the same search space, objective and settings. Fix: start "
            "every tuner from one script and one environment")


__all__ = ["STOP_GRACE", "WAIT_SLICE", "SearchService"]
