"""What this process is in a search, and the search service and client that go with it.

`open_session(planner, store=...)` is what a tuner library's adapter calls once,
with its planner and the search's store; it reads the engine's environment
(`stratkit.tuning.environment`) and returns the `Session`:

* alone (`python search.py`: no STRATKIT_TUNE_* variables): the service here,
  no listener; the client calls it directly;
* the host (`STRATKIT_TUNE_SERVE=1`: the launcher's worker 0): the service
  here, behind the run's listener (`hub`) on `STRATKIT_TUNE_ADDRESS`; direct calls;
* a tuner: the service elsewhere (the host, or the engine's driver); the wire,
  with the token.

An srun step of several tasks is a search of its own kind: its tasks learn
their parts from Slurm's variables (`stratkit.tuning.slurm`: task 0 hosts);
a multi-worker trial group's workers other than its chief follow it
(`stratkit.tuning.groups`).

Each call is the process's next search (0, 1, ...: a script may search
several times, the same in every tuner). Every tuner checks the store before it registers (`SearchStore.check`: the
store answers and takes writes) and after (it sees the handshake the service
wrote: a local path that is not shared between machines is refused). A tuner
whose check fails tells the service, and the search ends with that ConfigError
on every tuner, before any trial ran.

A process of a TF_CONFIG cluster that is not a tune run (`stratkit launch
--workers N` without `--tune`) is refused: every worker would run the whole
search.

Imports no TensorFlow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stratkit.cluster import detect
from stratkit.errors import ConfigError
from stratkit.tuning import environment, groups, protocol
from stratkit.tuning import slurm as tune_slurm
from stratkit.tuning.client import LocalChannel, SearchClient, WireChannel
from stratkit.tuning.hub import SearchHub
from stratkit.tuning.planner import Planner
from stratkit.tuning.search_store import SearchStore
from stratkit.tuning.service import SearchService

#: This process's searches so far (each `open_session` is the next: every tuner runs the same script), and the
#: run's listener when this process hosts (worker 0 of `stratkit launch --tune`).
_PROCESS: dict[str, Any] = {"searches": 0, "hub": None}


@dataclass
class Session:
    """This process's part in a search: its client, the service when it runs here, the store."""

    role: str  # "alone", "host", "tuner" or "follower" (a multi-worker trial group's other workers)
    client: SearchClient
    store: SearchStore
    service: SearchService | None = None
    env: environment.TuneEnv | None = None

    @property
    def tuner(self) -> int:
        return self.client.tuner

    @property
    def distributed(self) -> bool:
        return self.role != "alone"

    @property
    def group(self) -> tuple[int, int]:
        """(rank, size) of this process in its tuner's multi-worker trial group; (0, 1) alone."""
        return self.env.group if self.env is not None else (0, 1)

    @property
    def writes(self) -> bool:
        """Whether this process writes the search's files (a group's chief does, its followers do not)."""
        return self.role != "follower"

    def finish(self) -> None:
        """After this tuner heard the end: the host waits (bounded) until every other tuner heard it too, so
        none is left asking a service that is gone. A tuner asks nothing more (the host may be gone already); nor does a group's follower."""
        if self.service is not None and self.role == "host":
            self.service.wait_heard()

    def abort(self, error: str, kind: str = "config") -> None:
        """End the search for every tuner with `error` (`kind`: "config", a ConfigError; "failed", SearchFailed);
        the host then waits (bounded) until the others heard it or left, so each stops with the same error
        before its launcher, seeing the host's exit, stops it."""
        self.client.abort(error, kind)
        self.finish()

    def close(self) -> None:
        self.client.close()
        if self.service is not None:
            self.service.close()


def _refuse_cluster() -> None:
    spec = detect()
    if spec.num_workers > 1:
        raise ConfigError(f"this search runs as {spec.task_type}:{spec.task_index} of a cluster of {spec.num_workers} "
                          f"workers ({spec.source}) without a tune run: every worker would run the whole search. "
                          "Fix: `stratkit launch --tune --workers N -- python search.py`, or "
                          "LocalRunner(num_workers=N, tune=True), or run `python search.py` for one process")


def _hub(env: environment.TuneEnv) -> SearchHub:
    """The run's listener in this (host) process, made at its first search on the address the engine held."""
    if _PROCESS["hub"] is None:
        try:
            _PROCESS["hub"] = SearchHub(env.address[0], env.address[1], env.token, tuners=env.tuners)
        except OSError as exc:
            raise ConfigError(f"the search service cannot listen on {environment.format_address(*env.address)} "
                              f"({exc.strerror or exc}; {environment.ADDRESS_VAR}, set by {env.engine}). Fix: a free "
                              "port on an address of this machine") from None
    return _PROCESS["hub"]


def open_session(planner: Planner, *, store: str, lease_seconds: float | None = None,
                 strategy: Any = None) -> Session:
    """Join (or host) the search this process belongs to, with `planner` and the search's `store`.

    `strategy`: the tuner's MultiWorkerMirrored strategy when this process is a worker of a multi-worker trial
    group (`stratkit.tuning.groups`: its followers learn everything from its chief through it).

    Raises:
        ConfigError: the store cannot be used, this tuner's search differs from the service's, another tuner
            ended the search with a ConfigError, or the environment is not a tune run's.
        SearchUnreachable: the service could not be reached within STRATKIT_TUNE_CONNECT_SECONDS.
    """
    env = environment.from_environ() or tune_slurm.from_slurm()  # an engine's variables, else an srun step's
    search = _PROCESS["searches"]
    _PROCESS["searches"] += 1
    lease = lease_seconds if lease_seconds is not None else environment.seconds(environment.LEASE_VAR,
                                                                                 environment.LEASE_SECONDS)
    search_store = SearchStore(store)
    if env is not None and env.group[1] > 1:
        return _in_group(env, planner, search_store, lease, strategy, search)
    return _open(env, planner, search_store, lease, search)


def _in_group(env: environment.TuneEnv, planner: Planner, search_store: SearchStore, lease: float,
              strategy: Any, search: int) -> Session:
    """A multi-worker trial group's worker: its chief joins the search and publishes, the others follow."""
    kv = groups.store_of(strategy)
    if env.group[0] > 0:
        client = SearchClient(groups.FollowerChannel(kv, search, env.label), env.tuner)
        client.config = client.call("register")
        return Session("follower", client, search_store, None, env)
    session = _open(env, planner, search_store, lease, search)
    session.client.channel = groups.LeaderChannel(session.client.channel, kv, search)
    kv.insert(f"{groups.PREFIX}/{search}/config", json.dumps({"ok": session.client.config}))
    return session


def _open(env: environment.TuneEnv | None, planner: Planner, search_store: SearchStore, lease: float,
          search: int) -> Session:
    if env is None:
        _refuse_cluster()
        search_store.check()
        service = SearchService(search_store, tuners=1, lease_seconds=lease)
        client = SearchClient(LocalChannel(service, 0), 0)
        client.register_local(service, planner)
        return Session("alone", client, search_store, service)
    if env.serve:
        search_store.check()
        hub = _hub(env)
        service = SearchService(search_store, tuners=env.tuners, lease_seconds=lease, markers=env.markers,
                                start_seconds=environment.seconds(environment.START_VAR, environment.START_SECONDS),
                                search=search)
        hub.add(search, service)
        client = SearchClient(LocalChannel(service, env.tuner), env.tuner)
        client.register_local(service, planner)
        return Session("host", client, search_store, service, env)
    connection = protocol.Connection(env.address, env.token, env.tuner, env.label,
                                     connect_seconds=environment.seconds(environment.CONNECT_VAR,
                                                                         environment.CONNECT_SECONDS))
    client = SearchClient(WireChannel(connection, search), env.tuner, search_store)
    try:
        search_store.check()
    except ConfigError as exc:
        client.refuse(f"{env.label}: {exc}")  # ends the search for every tuner, and raises
        raise
    config = client.register(planner, search_store.path)
    try:
        search_store.check_handshake(str(config.get("nonce")), env.label)
    except ConfigError as exc:
        client.abort(str(exc))
        raise
    return Session("tuner", client, search_store, None, env)


__all__ = ["Session", "open_session"]
