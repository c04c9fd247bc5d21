"""The search service without a tuner library: leases, their expiry and re-runs, the start, the end, the stored
state, who may connect, and the refusals that end a search before any trial ran.

A real service (`SearchService` behind a real `SearchHub` on loopback), real clients in threads, a real store
directory; the planner is `Count`, a small deterministic search (the library side of the interface, which the
KerasTuner tests drive with the real thing). No TensorFlow.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from stratkit.errors import ConfigError
from stratkit.tuning import environment, protocol
from stratkit.tuning.client import LocalChannel, SearchClient, WireChannel
from stratkit.tuning.hub import SearchHub
from stratkit.tuning.planner import DONE, WAIT, Proposal, trial_seed
from stratkit.tuning.search_store import SearchStore
from stratkit.tuning.service import SearchService

TOKEN = "a" * 32


class Count:
    """Trials "0".."n-1", each scoring 2 * its number; `serial`: the next trial waits for every running one
    (as a planner whose next trial depends on results does)."""

    library = "count"

    def __init__(self, n: int, serial: bool = False) -> None:
        self.n, self.serial, self.seed = n, serial, 7
        self.made, self.running, self.scores, self.given_up = 0, set(), {}, {}

    def fingerprint(self):
        return {"n": self.n, "serial": self.serial}

    def propose(self):
        if self.serial and self.running:
            return WAIT
        if self.made >= self.n:
            return DONE
        trial = str(self.made)
        self.made += 1
        self.running.add(trial)
        return Proposal(trial, {"x": int(trial)}, trial_seed(self.seed, trial))

    def report(self, trial, data):
        return {"seen": data}

    def finish(self, trial, data):
        self.running.discard(trial)
        self.scores[trial] = data["score"]

    def give_up(self, trial, reason):
        self.running.discard(trial)
        self.given_up[trial] = reason

    def query(self, name, args):
        return self.scores

    def state(self):
        return {"made": self.made, "running": sorted(self.running), "scores": self.scores}

    def restore(self, state):
        self.made, self.running, self.scores = state["made"], set(state["running"]), state["scores"]

    def summary(self):
        return {"scores": self.scores}


def _hub(service: SearchService, tuners: int = 2) -> SearchHub:
    hub = SearchHub("127.0.0.1", 0, TOKEN, tuners=tuners)
    hub.add(0, service)
    return hub


def _client(hub: SearchHub, tuner: int, token: str = TOKEN, connect: float = 10.0) -> SearchClient:
    connection = protocol.Connection(hub.address, token, tuner, f"t{tuner}", connect_seconds=connect)
    return SearchClient(WireChannel(connection), tuner)


def _run_tuner(client: SearchClient, planner: Count, store: str, seen: list, stop_at: str | None = None) -> None:
    client.register(planner, store)
    while (lease := client.next()) is not None:
        seen.append((client.tuner, lease.trial_id, lease.run))
        client.built(lease)
        if lease.trial_id == stop_at:  # this tuner "dies" with its trial: the connection closes, nothing more
            client.close()
            return
        client.end(lease, {"score": 2 * lease.payload["x"]})


@pytest.fixture
def store(tmp_path: Path) -> SearchStore:
    return SearchStore(tmp_path / "store")


def test_two_tuners_share_the_trials_and_both_get_every_result(store):
    service = SearchService(store, tuners=2, lease_seconds=5)
    hub = _hub(service)
    try:
        seen: list = []
        clients = [_client(hub, i) for i in range(2)]
        threads = [threading.Thread(target=_run_tuner, args=(c, Count(6), store.path, seen)) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(t for _, t, _ in seen) == [str(i) for i in range(6)] and {r for _, _, r in seen} == {1}
        for client in clients:  # every tuner ends with the whole search's results
            assert client.final["summary"]["scores"] == {str(i): 2 * i for i in range(6)}
        state = json.loads((Path(store.path) / "search.json").read_text())
        assert state["done"] and state["ended"] == {str(i): 1 for i in range(6)}
    finally:
        hub.close()


def test_a_dead_tuners_trial_runs_again_on_another_and_its_late_result_is_refused(store):
    """A tuner whose connection closed mid-trial (its process died) loses the lease after the reconnect grace;
    the trial runs again, as run 2, on the other tuner; a message of the old run is refused (the fence)."""
    service = SearchService(store, tuners=2, lease_seconds=30)
    hub = _hub(service)
    try:
        seen: list = []
        dying, living = _client(hub, 0), _client(hub, 1)
        dying.register(Count(4), store.path)
        living.register(Count(4), store.path)
        first = dying.next()
        dying.built(first)
        dying.close()
        started = time.monotonic()
        _run_tuner(living, Count(4), store.path, seen)
        assert (1, first.trial_id, 2) in seen, seen  # the same trial, run 2, on tuner 1
        assert time.monotonic() - started < 30  # the closed connection, not the 30 s lease, ended it
        late = SearchClient(LocalChannel(service, 0), 0)
        assert late.end(first, {"score": -1}) is False  # run 1's result came too late: run 2's stands
        assert service.planner.scores[first.trial_id] == 2 * int(first.trial_id)
    finally:
        hub.close()


def test_a_silent_tuner_loses_its_lease_a_beating_one_keeps_it(store):
    """SIGSTOP in miniature: a lease nobody renews expires after lease_seconds; one whose heartbeats go on
    outlives it; after max_losses the trial is given up and the search still ends."""
    service = SearchService(store, tuners=1, lease_seconds=2.0, max_losses=2)
    client = SearchClient(LocalChannel(service, 0), 0)
    client.register_local(service, Count(2, serial=True))
    try:
        kept = client.next()  # its heartbeat thread renews it every lease_seconds / 6
        client.built(kept)
        time.sleep(3.0)
        assert client.end(kept, {"score": 0}) and not kept.lost.is_set()
        for run in (1, 2):
            lease = client.next()
            assert (lease.trial_id, lease.run) == ("1", run)
            client.release(lease)  # silent from now on: no heartbeat
            assert lease.lost.wait(0) is False
            deadline = time.monotonic() + 10
            while service.leases.current("1", run) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        assert client.next() is None  # given up after 2 losses: the search ended anyway
        assert "lost 2 times" in service.planner.given_up["1"]
    finally:
        service.close()


def test_a_planner_that_waits_while_nothing_runs_ends_the_search(store):
    """KerasTuner's Hyperband answers IDLE when a round cannot fill (its trials failed): its tuners spun on it
    forever. Here the planner's WAIT with no trial running or waiting to run again ends the search."""

    class Stuck(Count):
        def propose(self):
            return WAIT if self.made else super().propose()

    service = SearchService(store, tuners=1, lease_seconds=5)
    client = SearchClient(LocalChannel(service, 0), 0)
    client.register_local(service, Stuck(3))
    try:
        lease = client.next()
        client.built(lease)
        client.end(lease, {"score": 0})
        assert client.next() is None and client.final["summary"]["scores"] == {"0": 0}
    finally:
        service.close()


def test_a_restarted_service_resumes_and_never_runs_a_finished_trial_again(store):
    first = SearchService(store, tuners=1, lease_seconds=5)
    client = SearchClient(LocalChannel(first, 0), 0)
    client.register_local(first, Count(5))
    for _ in range(2):
        lease = client.next()
        client.built(lease)
        client.end(lease, {"score": 2 * lease.payload["x"]})
    running = client.next()  # trial 2 was running when the service's process died
    first.close()
    client.release(running)

    second = SearchService(store, tuners=1, lease_seconds=5)
    client = SearchClient(LocalChannel(second, 0), 0)
    client.register_local(second, Count(5))
    seen = []
    while (lease := client.next()) is not None:
        seen.append((lease.trial_id, lease.run))
        client.built(lease)
        client.end(lease, {"score": 2 * lease.payload["x"]})
    assert seen == [("2", 2), ("3", 1), ("4", 1)]  # trial 2 again (run 2), trials 0 and 1 never
    assert client.final["summary"]["scores"] == {str(i): 2 * i for i in range(5)}
    second.close()


def test_a_store_holding_another_search_is_refused(store):
    service = SearchService(store, tuners=1)
    client = SearchClient(LocalChannel(service, 0), 0)
    client.register_local(service, Count(3))
    lease = client.next()
    client.end(lease, {"score": 0})
    service.close()
    other = SearchService(store, tuners=1)
    with pytest.raises(ConfigError, match=r"holds another search \(n: 4 vs 3\).*Fix: give this search its own store"):
        SearchClient(LocalChannel(other, 0), 0).register_local(other, Count(4))
    other.close()


def test_no_trial_before_every_tuner_registered_or_the_start_bound(store):
    service = SearchService(store, tuners=2, lease_seconds=5, start_seconds=1.0)
    client = SearchClient(LocalChannel(service, 0), 0)
    client.register_local(service, Count(2))
    try:
        assert client.call("next", wait=0.3) == {"wait": True}  # tuner 1 has not registered
        started = time.monotonic()
        lease = client.next()  # the start bound passed: the search goes on with the tuners it has
        assert lease.trial_id == "0" and time.monotonic() - started < 5
        again = client.call("next")["trial"]  # asked again (a lost reply): the same lease, not a second trial
        assert (again["trial"], again["run"]) == ("0", 1)
    finally:
        service.close()


def test_no_second_trial_before_the_first_ones_model_built(store):
    service = SearchService(store, tuners=2, lease_seconds=5)
    a, b = (SearchClient(LocalChannel(service, i), i) for i in range(2))
    a.register_local(service, Count(3))
    b.register_local(service, Count(3))
    try:
        first = a.next()
        assert first.first and b.call("next", wait=0.3) == {"wait": True}
        a.built(first)
        assert b.next().trial_id == "1"
    finally:
        service.close()


@pytest.mark.parametrize("failure", ["store", "fingerprint", "abort"])
def test_one_tuners_refusal_ends_the_search_on_every_tuner_before_any_trial(store, failure, tmp_path):
    """A tuner that cannot reach the store, builds another search, or finds the first trial's model does not
    build: every tuner (the host too) gets the same ConfigError, and no trial was handed out."""
    markers = str(tmp_path / "markers")
    service = SearchService(store, tuners=2, lease_seconds=5, markers=markers)
    hub = _hub(service)
    try:
        host = SearchClient(LocalChannel(service, 0), 0)
        host.register_local(service, Count(3))
        tuner = _client(hub, 1)
        with pytest.raises(ConfigError) as raised:
            if failure == "store":
                tuner.refuse("tuner 1: store='s3://nowhere/x': the store did not answer. Fix: check the store")
            elif failure == "fingerprint":
                tuner.register(Count(4), store.path)
            else:
                tuner.register(Count(3), store.path)
                tuner.abort("the model-building function fails on the search's first hyperparameters")
                tuner.next()
        with pytest.raises(ConfigError) as on_host:
            host.next()
        assert str(on_host.value) == str(raised.value)
        assert service.leases.runs == {} and not environment.started(markers)
    finally:
        hub.close()


def test_a_tuner_that_sees_another_store_is_refused(tmp_path):
    """A local path on two machines is two directories: the tuner does not find the service's handshake."""
    mine, theirs = SearchStore(tmp_path / "host"), SearchStore(tmp_path / "tuner")
    nonce = mine.write_handshake()
    theirs.write_handshake()
    with pytest.raises(ConfigError, match=r"does not see the search's files.*finds another one.*Fix: give the search "
                                          r"a store every tuner reaches"):
        theirs.check_handshake(nonce, "tuner 1")


def _listening_sockets(port: int) -> set[str]:
    """The addresses LISTEN sockets hold `port` on, from /proc/net/tcp{,6} (no connect to any address)."""
    import ipaddress

    found = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    raw = bytes.fromhex(address)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(str(ipaddress.ip_address(raw)))
    return found


def test_the_service_listens_on_loopback_only_and_refuses_a_client_without_the_token(store):
    service = SearchService(store, tuners=2, lease_seconds=5)
    hub = _hub(service)
    try:
        assert _listening_sockets(hub.address[1]) == {"127.0.0.1"}
        with pytest.raises(ConfigError, match="refused this tuner's token"):
            _client(hub, 1, token="b" * 32, connect=5).call("next")
        with socket.create_connection(hub.address, timeout=5) as raw:  # no HELLO at all: closed, nothing answered
            raw.sendall(b'{"op": "query", "name": "scores"}\n')
            raw.settimeout(15)
            assert raw.recv(100) == b""
        assert hub.rejected == 2
        client = _client(hub, 1)
        client.register(Count(3), store.path)  # the run's token: served
        assert client.query("scores") == {}
    finally:
        hub.close()


def test_a_search_its_host_has_not_reached_yet_is_asked_again(store):
    """A script may search several times; a fast tuner's second search waits for the host's (bounded)."""
    hub = SearchHub("127.0.0.1", 0, TOKEN, tuners=2)
    try:
        connection = protocol.Connection(hub.address, TOKEN, 1, "t1", connect_seconds=10)
        early = SearchClient(WireChannel(connection, search=1), 1)
        answered = []
        thread = threading.Thread(target=lambda: answered.append(early.register(Count(2), store.path)))
        thread.start()
        time.sleep(0.5)
        assert not answered
        service = SearchService(store, tuners=2, search=1)
        hub.add(1, service)
        SearchClient(LocalChannel(service, 0), 0).register_local(service, Count(2))
        thread.join(10)
        assert answered and answered[0]["nonce"] == service.nonce
    finally:
        hub.close()


def test_the_tune_environment_is_checked():
    with pytest.raises(ConfigError, match=r"STRATKIT_TUNE_TOKEN must be at least 16.*Fix"):
        environment.from_environ({environment.ADDRESS_VAR: "127.0.0.1:5", environment.TUNE_TOKEN_VAR: "short"})
    with pytest.raises(ConfigError, match=r"STRATKIT_TUNE_ADDRESS='nowhere' is not host:port"):
        environment.from_environ({environment.ADDRESS_VAR: "nowhere", environment.TUNE_TOKEN_VAR: TOKEN})
    env = environment.task_env(("127.0.0.1", 5), TOKEN, 1, 2, serve=False, markers="/tmp/m", engine="x")
    parsed = environment.from_environ(env)
    assert (parsed.address, parsed.tuner, parsed.tuners, parsed.serve) == (("127.0.0.1", 5), 1, 2, False)
    assert environment.from_environ({}) is None


def test_a_tuner_that_cannot_reach_the_store_ends_the_search_before_any_trial(store, store_server, monkeypatch):
    """The real tuner's path (`session.open_session` with the engine's variables): its store check fails (a
    bucket missing on S3, moto), and the host's first `next` gets the same ConfigError."""
    from stratkit.tuning import session

    s3 = store_server("s3")
    service = SearchService(store, tuners=2, lease_seconds=5)
    hub = SearchHub("127.0.0.1", 0, TOKEN, tuners=2)
    hub.add(session._PROCESS["searches"], service)  # the search number this process's next session takes
    try:
        host = SearchClient(LocalChannel(service, 0), 0)
        host.register_local(service, Count(3))
        for key, value in {**s3.env, **environment.task_env(hub.address, TOKEN, 1, 2, engine="a test")}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("STRATKIT_STORE_TIMEOUT", "120")   # a bound for a loaded machine: moto answers in <1 s
        with pytest.raises(ConfigError, match=r"tuner 1: store='s3://no-such-bucket-for-tuning/search': the bucket "
                                              r"or container 'no-such-bucket-for-tuning' does not exist"):
            session.open_session(Count(3), store="s3://no-such-bucket-for-tuning/search")
        with pytest.raises(ConfigError, match=r"the bucket or container 'no-such-bucket-for-tuning' does not exist"):
            host.next()
        assert service.leases.runs == {}
    finally:
        hub.close()


def test_a_tuner_that_asks_after_the_host_left_reads_the_end_from_the_store(store):
    """The host waits (bounded) for every tuner to hear the end, then leaves; a tuner slower than that (a loaded
    machine) finds nobody to ask: it reads the end the service stored, instead of retrying for its connect time."""
    service = SearchService(store, tuners=2, lease_seconds=5)
    hub = _hub(service)
    connection = protocol.Connection(hub.address, TOKEN, 1, "t1", connect_seconds=120)
    late = SearchClient(WireChannel(connection), 1, store)
    late.register(Count(1), store.path)
    host = SearchClient(LocalChannel(service, 0), 0)
    host.register_local(service, Count(1))
    lease = host.next()
    host.built(lease)
    host.end(lease, {"score": 0})
    assert host.next() is None
    hub.close()  # the host's process ended
    connection.close()
    late_connection = protocol.Connection(hub.address, TOKEN, 1, "t1", connect_seconds=120)
    late = SearchClient(WireChannel(late_connection), 1, store)
    started = time.monotonic()
    assert late.next() is None and late.final["summary"]["scores"] == {"0": 0}
    assert time.monotonic() - started < 10
