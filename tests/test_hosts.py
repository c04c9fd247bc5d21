"""The test hosts fixture (tests/hosts.py): isolated, reachable by name, and gone after the test."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext

import pytest

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
            # a detached grandchild that would outlive the test (its parent exits: nobody waits for it)
            spawner = made[1].popen(["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 & echo $!"],
                                    stdout=subprocess.PIPE, text=True)
            pids.append(int(spawner.communicate(timeout=10)[0]))
            namespaces += [h.netns for h in made]
            assert set(namespaces) <= set(hosts.our_namespaces())
            assert pids[0] in made[1].pids() and alive(pids[0])
            if fail:
                raise RuntimeError("the test failed")
    assert not any(alive(p) for p in pids)
    prefix = namespaces[0].rsplit("-", 1)[0] + "-"
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
        hosts.gate()
    monkeypatch.setenv(hosts.REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match="STRATKIT_REQUIRE_HOSTS=1 but test hosts need root"):
        hosts.gate()
    monkeypatch.setattr(hosts, "unavailable_reason", lambda: None)
    hosts.gate()


WRITE_EVERYWHERE = """
import os, sys
name = sys.argv[1]
for directory in ("/tmp", "/var/tmp", os.path.expanduser("~"), os.path.expanduser("~/.cache"), os.getcwd()):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"stratkit-disk-{name}"), "w") as handle:
        handle.write(name)
with open(os.path.join(sys.argv[2], f"from-{name}"), "w") as handle:
    handle.write(name)
print("cwd", os.getcwd())
"""

LOOK = """
import glob, os, sys
paths = ["/tmp", "/var/tmp", os.path.expanduser("~"), os.path.expanduser("~/.cache"), os.getcwd()]
print(sorted(os.path.basename(p) for d in paths for p in glob.glob(os.path.join(d, "stratkit-disk-*"))))
print(sorted(os.listdir(sys.argv[1])))
print(os.path.exists(os.path.expanduser("~/.pyenv")))
"""


@pytest.mark.hosts
def test_private_disks_a_file_written_on_one_host_is_seen_by_no_other_nor_by_this_machine(tmp_path):
    """`make_hosts(private_disks=True)`: /tmp, /var/tmp, the home (and so the working directory and ~/.cache) are
    each host's own; the shared directory is the one way across; the image (Python, the repository) is everyone's."""
    shared = tmp_path / "results"
    shared.mkdir()
    name = f"{os.getpid()}-{os.urandom(3).hex()}"   # this run's: a leftover of another run cannot pass the test
    home = os.path.expanduser("~")
    with hosts.make_hosts(2, private_disks=True, shared=[shared]) as (h1, h2):
        assert h1.home == h2.home == home
        wrote = h1.run([sys.executable, "-c", WRITE_EVERYWHERE, f"h1-{name}", str(shared)], timeout=60)
        assert wrote.returncode == 0 and wrote.stdout.strip() == f"cwd {home}", wrote.stdout
        for host, mine in ((h1, 5), (h2, 0)):
            seen = host.run([sys.executable, "-c", LOOK, str(shared)], timeout=60)
            lines = seen.stdout.splitlines()
            assert seen.returncode == 0 and len(lines) == 3, seen.stdout
            assert lines[0] == str([f"stratkit-disk-h1-{name}"] * mine), (host.name, lines[0])
            assert lines[1] == str([f"from-h1-{name}"]) and lines[2] == "True", (host.name, lines)
        # this machine sees none of h1's files but the shared one; h2 writes there too and h1 sees it
        for directory in ("/tmp", "/var/tmp", home, os.path.join(home, ".cache")):
            assert not os.path.exists(os.path.join(directory, f"stratkit-disk-h1-{name}")), directory
        assert (shared / f"from-h1-{name}").read_text() == f"h1-{name}"
        h2.run(["sh", "-c", f"echo h2 > {shared}/from-h2"], timeout=30, check=True)
        assert h1.run(["cat", f"{shared}/from-h2"], timeout=30).stdout.strip() == "h2"
        # the network guard's log is this machine's file on every host (a refusal on a host fails the test)
        guard = os.environ[hosts.GUARD_LOG_VARIABLE]
        seen = h2.run(["stat", "--format=%d %i", guard], timeout=30).stdout.strip()
        assert seen == f"{os.stat(guard).st_dev} {os.stat(guard).st_ino}", seen
        mounts = h1.run(["cat", "/proc/self/mounts"], timeout=30).stdout
        assert "disk-h1 /tmp tmpfs" in mounts and f"home-h1 {home} overlay" in mounts, mounts
    with open("/proc/self/mounts") as handle:   # nothing of the hosts' disks in this machine's mount table
        assert "disk-h1" not in handle.read()
