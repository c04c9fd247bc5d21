"""A tuner's end of the search: register, take a trial as a lease, keep it alive, report, end it.

Every tuner library's adapter runs its trials through `SearchClient`: the
lease comes with a heartbeat thread that renews it every `heartbeat` seconds
(independent of training, so a long epoch keeps it; a stopped process does
not); a renewal the service refuses, or a service out of reach for the lease's
life, sets `Lease.lost`, and the adapter stops that trial at its next step
(another tuner runs it now). The channel is the wire (`protocol.Connection`)
or, in the process that hosts the service, direct calls through the same JSON
(`LocalChannel`), so a search in one process takes the same path as N tuners.

Imports no TensorFlow.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from stratkit import status
from stratkit.tuning import protocol
from stratkit.tuning.planner import Planner

log = status.logger(__name__)


class Channel(Protocol):
    def request(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        """The reply to one request (raw: {"ok": ...} or an error); `fallback()` may answer while the service
        cannot be reached (`protocol.Connection.request`)."""

    def close(self) -> None: ...


class LocalChannel:
    """Requests to a service in this process, through the same JSON the wire carries."""

    def __init__(self, service: Any, tuner: int) -> None:
        self.service = service
        self.tuner = tuner

    def request(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        request = json.loads(json.dumps({"op": op, **fields}))
        return json.loads(json.dumps(self.service.handle(self.tuner, request)))

    def close(self) -> None:
        pass


class WireChannel:
    """Requests to search number `search` of the run, over an authenticated connection (`protocol.Connection`);
    a search its host has not reached yet ("retry") is asked again, for the connection's connect time."""

    def __init__(self, connection: protocol.Connection, search: int = 0) -> None:
        self.connection = connection
        self.search = search

    def request(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.connection.connect_seconds
        while True:
            reply = self.connection.request(op, fallback=fallback, search=self.search, **fields)
            if reply.get("kind") != "retry":
                return reply
            if time.monotonic() > deadline:
                raise protocol.SearchUnreachable(f"{reply.get('error')} after {self.connection.connect_seconds:g} "
                                                 "s: the host's script does not start this search")
            time.sleep(0.2)

    def close(self) -> None:
        self.connection.close()


@dataclass
class Lease:
    """A trial this tuner runs: its id, run number, what to run, its seed; `lost` once the service took it back."""

    trial_id: str
    run: int
    payload: dict[str, Any]
    seed: int
    first: bool
    heartbeat: float
    lost: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


class SearchClient:
    """One tuner's requests to the search service (see the module's docstring)."""

    def __init__(self, channel: Channel, tuner: int, store: Any = None) -> None:
        self.channel = channel
        self.tuner = tuner
        #: The search's `SearchStore`: where a tuner reads the end when the host ended the search and left.
        self.store = store
        self.config: dict[str, Any] = {}
        #: The search's results once it ended ({"summary": planner.summary(), "ended": {trial: run}}).
        self.final: dict[str, Any] | None = None

    def call(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        return protocol.raise_for(self.channel.request(op, fallback, **fields))

    def _stored_end(self) -> dict[str, Any] | None:
        """The search's end as the service stored it, when it ended (its host may have left since)."""
        try:
            state = self.store.read_state() if self.store is not None else None
        except Exception:  # noqa: BLE001 - a store that does not answer now: keep trying the service
            return None
        if state and state.get("done") and state.get("final") is not None:
            return {"ok": {"stop": state["final"]}}
        return None

    def register_local(self, service: Any, planner: Planner) -> dict[str, Any]:
        """Join a service in this process with its planner (no pickling)."""
        self.config = service.register_planner(self.tuner, planner)
        return self.config

    def register(self, planner: Planner, store: str) -> dict[str, Any]:
        """Join the search over the wire; the planner travels (cloudpickled) only when the service has none yet
        (a driver that never built the user's search).

        Returns the search's settings: nonce (the store's handshake), store, heartbeat, lease_seconds, seed.
        Raises ConfigError when this tuner's search differs from the service's, or the search failed.
        """
        fingerprint = planner.fingerprint()
        reply = self.call("register", fingerprint=fingerprint, store=store)
        if reply.get("need_planner"):
            import cloudpickle

            blob = base64.b64encode(cloudpickle.dumps(planner)).decode("ascii")
            reply = self.call("register", fingerprint=fingerprint, store=store, planner=blob)
        self.config = reply
        return reply

    def refuse(self, error: str) -> None:
        """This tuner cannot take part (its store check failed): the search ends with `error` (a ConfigError,
        raised here too) on every tuner, before any trial ran."""
        self.call("register", error=error)

    def next(self) -> Lease | None:
        """The next trial to run (waiting as long as the search needs), or None when the search ended."""
        while True:
            reply = self.call("next", fallback=self._stored_end)
            if "stop" in reply:
                self.final = reply["stop"]
                return None
            if "trial" in reply:
                data = reply["trial"]
                lease = Lease(str(data["trial"]), int(data["run"]), dict(data.get("payload") or {}),
                              int(data.get("seed") or 0), bool(data.get("first")), float(data["heartbeat"]))
                threading.Thread(target=self._keep, args=(lease,), name=f"stratkit-lease-{lease.trial_id}",
                                 daemon=True).start()
                return lease

    def _keep(self, lease: Lease) -> None:
        """Renew `lease` until it ends; mark it lost when the service refuses, or cannot be reached in time."""
        last_ok = time.monotonic()
        while not lease.ended.wait(lease.heartbeat):
            try:
                alive = bool(self.call("beat", trial=lease.trial_id, run=lease.run).get("alive"))
            except Exception as exc:  # noqa: BLE001 - unreachable, or the search failed: judged below
                log.debug("heartbeat for trial %s failed: %s", lease.trial_id, exc)
                alive = time.monotonic() - last_ok < 6 * lease.heartbeat  # the lease's life on the service
            if not alive and lease.ended.is_set():
                return  # a beat that crossed this lease's end: the lease ended, it was not lost
            if not alive:
                log.warning("trial %s (run %d) was taken back by the search service (its lease expired): this "
                            "tuner stops it, another runs it", lease.trial_id, lease.run)
                lease.lost.set()
                return
            last_ok = time.monotonic()

    def built(self, lease: Lease) -> None:
        """The first trial's model built: the service lets the other trials start."""
        if lease.first:
            self.call("built", trial=lease.trial_id, run=lease.run)

    def report(self, lease: Lease, data: dict[str, Any]) -> dict[str, Any] | None:
        """An intermediate result; the planner's reply, or None when the lease was lost."""
        reply = self.call("report", trial=lease.trial_id, run=lease.run, data=data)
        if not reply.get("alive"):
            lease.lost.set()
            return None
        return reply.get("reply") or {}

    def end(self, lease: Lease, data: dict[str, Any]) -> bool:
        """End the trial with its result; False when the lease was lost (the result is another run's now)."""
        lease.ended.set()  # no heartbeat after this: one that crossed the end must not call the lease lost
        accepted = bool(self.call("end", trial=lease.trial_id, run=lease.run, data=data).get("accepted"))
        if not accepted:
            lease.lost.set()
        return accepted

    def release(self, lease: Lease) -> None:
        """Stop renewing `lease` (its trial stopped without a result: the lease expires on the service)."""
        lease.ended.set()

    def abort(self, error: str, kind: str = "config") -> None:
        """End the search for every tuner with `error`: a ConfigError ("config"), or SearchFailed ("failed")."""
        self.call("abort", error=error, kind=kind)

    def query(self, name: str, *, write: bool = False, **args: Any) -> Any:
        """The planner's answer to `name` (`planner.query`); `write`: it changes the search (stored first)."""
        return self.call("query", name=name, args=args, **({"write": True} if write else {})).get("value")

    def files_run(self, trial_id: str) -> int | None:
        """The run whose files are the trial's (the one that ended it), or None."""
        if self.final is not None:
            run = (self.final.get("ended") or {}).get(trial_id)
        else:
            run = self.call("files", trial=trial_id).get("run")
        return None if run is None else int(run)

    def close(self) -> None:
        self.channel.close()


__all__ = ["Channel", "Lease", "LocalChannel", "SearchClient", "WireChannel"]
