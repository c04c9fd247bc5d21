"""The test hosts fixture (tests/hosts.py): isolated, reachable by name, and gone after the test."""

from __future__ import annotations

import subprocess
import sys
from contextlib import nullcontext

import pytest

import conftest
import hosts
from procs import alive

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
print("listening", flush=True)
conn, peer = s.accept()
conn.sendall(("hello " + peer[0]).encode())
conn.close()
"""

CLIENT = """
import socket, sys
with socket.create_connection(("h2", int(sys.argv[1])), timeout=10) as c:
    print(c.recv(100).decode())
"""

PORT = 45321


def _listening_ports(host: hosts.Host) -> set[int]:
    """TCP ports in LISTEN state in the host's own /proc/net/tcp and tcp6 (read, never dialed)."""
    text = host.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout=10, check=True).stdout
    ports = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.hosts
def test_hosts_reach_each_other_by_name_and_nothing_else(two_hosts):
    h1, h2 = two_hosts
    assert [(h.name, h.address) for h in two_hosts] == [("h1", "198.18.0.1"), ("h2", "198.18.0.2")]
    server = h2.popen([sys.executable, "-c", SERVER, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    assert PORT in _listening_ports(h2)
    assert PORT not in _listening_ports(h1), "h1 sees h2's listener: the hosts share a network namespace"
    client = h1.run([sys.executable, "-c", CLIENT, str(PORT)], timeout=30)
    assert client.returncode == 0, client.stdout
    assert client.stdout.strip() == "hello 198.18.0.1"
    assert server.wait(timeout=10) == 0
    # Own names; the only routes are loopback and the test network.
    assert h1.run(["hostname"], timeout=10).stdout.strip() == "h1"
    routes = h1.run(["ip", "-4", "route"], timeout=10).stdout
    assert routes.strip() == "198.18.0.0/24 dev eth0 proto kernel scope link src 198.18.0.1", routes


@pytest.mark.hosts
@pytest.mark.parametrize("fail", [False, True], ids=["passed", "raised"])
def test_teardown_kills_leftovers_and_removes_namespaces(fail):
    namespaces: list[str] = []
    pids: list[int] = []
    with pytest.raises(RuntimeError) if fail else nullcontext():
        with hosts.make_hosts(2) as made:
            # a detached process that would outlive the test: own session, not waited for
            sleeper = made[1].popen(["sleep", "1000"], start_new_session=True)
            pids.append(sleeper.pid)
            namespaces += [h.netns for h in made]
            assert set(namespaces) <= set(hosts.our_namespaces())
            assert sleeper.pid in made[1].pids()
            if fail:
                raise RuntimeError("the test failed")
    sleeper.wait(timeout=10)   # reap it: it was SIGKILLed by the teardown, not by us
    assert sleeper.returncode == -9
    assert not any(alive(p) for p in pids)
    prefix = namespaces[0].rsplit("-", 1)[0]
    assert not [n for n in hosts.our_namespaces() if n.startswith(prefix)]


@pytest.mark.hosts
def test_namespaces_left_by_a_killed_run_are_swept():
    stale = f"{hosts.PREFIX}999999999-0-h1"    # no such pid
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with hosts.make_hosts(1, names=False) as (h1,):
            assert stale not in hosts.our_namespaces()
            assert h1.run(["ip", "-br", "addr", "show", "eth0"], timeout=10).stdout.split()[2] == "198.18.0.1/24"
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_skip_becomes_a_failure_when_hosts_are_required(monkeypatch):
    monkeypatch.setattr(hosts, "unavailable_reason", lambda: "test hosts need root")
    monkeypatch.delenv(hosts.REQUIRE_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="need root"):
        conftest.hosts_gate()
    monkeypatch.setenv(hosts.REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match="STRATKIT_REQUIRE_HOSTS=1 but test hosts need root"):
        conftest.hosts_gate()
    monkeypatch.setattr(hosts, "unavailable_reason", lambda: None)
    conftest.hosts_gate()
