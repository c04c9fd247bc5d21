"""`stratkit launch` and the network: no TensorFlow server of a local launch can be reached from outside.

TensorFlow's gRPC server listens on 0.0.0.0 whatever address TF_CONFIG names,
and runs any graph a client sends. A local launch therefore runs its tasks in a
private network namespace that has only loopback; where that is impossible or
turned off, it says so at start. These tests inspect the sockets of real runs:
the tasks' own /proc/<pid>/net tables (their namespace's view) and this
machine's: a port is exposed when a LISTEN socket holds it on a wildcard or
non-loopback address. No test dials any address but loopback to prove it.

Some tests run the launcher under `unshare(1)` to be, for real, an unprivileged
user (`--map-user=1000`: no capabilities) or a user the kernel refuses namespaces
to (`--user` without a mapping: unshare(CLONE_NEWUSER) fails with EPERM).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import child_env
from test_launch import _alive, _assert_all_gone, _Launcher, _launch_argv, _pids, _script

from stratkit.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(("STRATKIT_", "SLURM_")):
            monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------
# helpers: what a process's namespace shows, what this machine's addresses are
# ---------------------------------------------------------------------------------------------
def _netns(pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _listeners(pid: int | str = "self") -> set[tuple[str, int, int]]:
    """(local address in hex, port, socket inode) of every TCP socket in LISTEN in `pid`'s network namespace."""
    found = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    address, port = fields[1].rsplit(":", 1)
                    found.add((address, int(port, 16), int(fields[9])))
    return found


def _listening(pid: int | str = "self") -> set[tuple[str, int]]:
    """(local address in hex, port) of every TCP socket in LISTEN in `pid`'s network namespace."""
    return {(address, port) for address, port, _ in _listeners(pid)}


def _tree(root: int) -> set[int]:
    """`root` and every process descended from it, alive now."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass                                # ended while we looked
    tree, grew = {root}, True
    while grew:
        added = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= added
        grew = bool(added)
    return tree


def _sockets_of(pids: set[int]) -> set[int]:
    """Inodes of the sockets the processes `pids` hold open (an inode is unique across network namespaces)."""
    inodes = set()
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue                                # ended while we looked
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _ours_here(ours: set[int]) -> set[tuple[str, int]]:
    """(address, port) of the LISTEN sockets in this machine's namespace that the processes holding `ours` own.

    By owner, not by port number: under `make test` other tests' programs listen here too, and one of them may
    hold, by chance, the number a task's server holds inside its own namespace."""
    return {(address, port) for address, port, inode in _listeners() if inode in ours}


def _interfaces(pid: int | str = "self") -> set[str]:
    with open(f"/proc/{pid}/net/dev") as handle:
        return {line.split(":")[0].strip() for line in handle.read().splitlines()[2:]}


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    return getattr(address, "ipv4_mapped", None) or address


def _exposed(listeners: set[tuple[str, int]]) -> set[int]:
    """Ports of LISTEN sockets another machine could reach: bound to a wildcard or a non-loopback address.

    Judged from the listener table alone, without a connect() to any address of this machine."""
    return {port for address, port in listeners if not _address(address).is_loopback}


def _refused(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return False
    except OSError:
        return True


def _can_unshare(*args: str) -> bool:
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        return False
    return subprocess.run(["unshare", *args, "true"], capture_output=True).returncode == 0


def _run_as(prefix: list[str], args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(prefix + _launch_argv(*args), env=child_env(None, None), capture_output=True, text=True,
                          timeout=timeout)


def _addresses(launcher_stderr: str) -> dict[str, int]:
    return {task: int(port) for task, port in re.findall(r"(\w+:\d+) started: pid \d+ at [\d.]+:(\d+)",
                                                          launcher_stderr)}


def _holder(launcher_stderr: str) -> list[int]:
    return [int(p) for p in re.findall(r"private network namespace.*held by pid (\d+)", launcher_stderr)]


WARNING = "WARNING: every task's TensorFlow gRPC server listens on all interfaces"
#: The launcher runs unprivileged here: an unshare(1) user namespace, uid 1000, no capabilities.
UNPRIVILEGED = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
#: A user the kernel refuses new namespaces to: no uid mapping, so unshare(CLONE_NEWUSER) fails with EPERM.
NO_NAMESPACES = ["unshare", "--user"]


# ---------------------------------------------------------------------------------------------
# fast
# ---------------------------------------------------------------------------------------------
def test_the_multi_host_plan_says_the_cluster_network_must_be_private(capsys):
    assert main(["launch", "--hosts", "h1,h2", "--print-tf-config", "--", "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"no authentication.*runs any graph", out, re.S), out
    assert "network between the hosts must be private to the cluster" in out


def test_a_private_network_needs_a_loopback_host(capsys):
    code = main(["launch", "--private-network", "--host", "192.0.2.7", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2 and "--private-network" in err and "--host 192.0.2.7" in err and "Fix:" in err, err


# ---------------------------------------------------------------------------------------------
# slow: real TensorFlow servers in the private network
# ---------------------------------------------------------------------------------------------
MWMS_PROBE = """
    import json, os, sys, time
    import stratkit
    strategy = stratkit.make_strategy()
    import tensorflow as tf
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # both servers talk
    print(json.dumps({"sum": float(total), "pid": os.getpid()}), flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:   # the test inspects us meanwhile
        time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.skipif(not _can_unshare("--user", "--map-root-user", "--net"), reason="no user+network namespaces")
def test_an_isolated_two_worker_launch_listens_on_loopback_only(tmp_path):
    checked = tmp_path / "checked"
    launcher = _Launcher(["--workers", "2", "--private-network", "--log-dir", str(tmp_path / "logs"), "--",
                          sys.executable, _script(tmp_path, MWMS_PROBE), str(checked)])
    try:
        reports = [json.loads(m.group(1)) for m in launcher.wait_for(r"^\[worker:\d\] (\{.*\"sum\".*\})$", 2,
                                                                      timeout=90)]
        assert [r["sum"] for r in reports] == [2.0, 2.0]       # a real collective over both gRPC servers
        ports = _addresses(launcher.stderr)
        assert set(ports) == {"worker:0", "worker:1"}
        inside: set[tuple[str, int]] = set()
        for report in reports:
            pid = report["pid"]
            assert _netns(pid) != _netns()                     # not in the machine's network namespace
            assert _interfaces(pid) == {"lo"}                  # ... but in one that has only loopback
            inside |= _listening(pid)
            assert {port for _, port in _listening(pid)} >= set(ports.values())   # TF listens there (on 0.0.0.0)
        pids = _tree(launcher.proc.pid) | set(_holder(launcher.stderr)) | {
            p for ps in _pids(launcher.stderr).values() for p in ps}
        ours = _sockets_of(pids)
        assert ours, f"no socket found among the launch's processes {sorted(pids)}"
        here = _ours_here(ours)
        for task, port in ports.items():
            # not listening in the machine's namespace at all (so on none of its addresses: exposed or not)
            assert port not in {p for _, p in here}, f"{task}'s port {port} listens in the machine's namespace"
            if port not in {p for _, p in _listening()}:      # else a stranger holds that number here
                assert _refused("127.0.0.1", port), f"{task}'s TF server is reachable at 127.0.0.1:{port}"
            assert port in _exposed(inside)                    # TF's wildcard bind: exposed, but only to `lo`
        assert not _exposed(here), f"the launch listens beyond loopback in the machine's namespace: {here}"
        # Owners told apart: strangers listening here on the tasks' port numbers are in the table, not ours.
        strangers = [socket.create_server(("127.0.0.1", port)) for port in ports.values()
                     if port not in {p for _, p in _listening()}]
        try:
            taken = {s.getsockname()[1] for s in strangers}
            assert taken <= {p for _, p in _listening()} and not taken & {p for _, p in _ours_here(ours)}
            assert taken <= {p for _, p in _ours_here(ours | _sockets_of({os.getpid()}))}
        finally:
            for stranger in strangers:
                stranger.close()
        assert WARNING not in launcher.stderr
        assert launcher.stderr.count("private network namespace") == 1
        checked.touch()
        assert launcher.finish(timeout=60) == 0, launcher.stderr
        events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
        released = {e["task"] for e in events if e["event"] == "port_released" and e["reason"] == "listening"}
        assert released == {"worker:0", "worker:1"}            # held ports work inside the namespace too
        _assert_all_gone([p for ps in _pids(launcher.stderr).values() for p in ps] + _holder(launcher.stderr))
    finally:
        checked.touch()
        launcher.kill()


# ---------------------------------------------------------------------------------------------
# slow: plain processes -- who is isolated, who is warned, restarts, cleanup
# ---------------------------------------------------------------------------------------------
# worker:1 serves on its TF_CONFIG port (SO_REUSEPORT, as TensorFlow's server does, taking over the
# launcher's held port); worker:0 dials it. On the first attempt worker:1 fails instead: a restart.
LOOPBACK_PAIR = """
    import json, os, socket, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    index, peer = config["task"]["index"], config["cluster"]["worker"][1]
    host, port = peer.rsplit(":", 1)
    with open("/proc/self/net/dev") as handle:
        interfaces = sorted(line.split(":")[0].strip() for line in handle.read().splitlines()[2:])
    print(json.dumps({"index": index, "uid": os.getuid(), "interfaces": interfaces, "pid": os.getpid(),
                      "attempt": os.environ["STRATKIT_RESTART_COUNT"]}), flush=True)
    if index == 1:
        if os.environ["STRATKIT_RESTART_COUNT"] == "0":
            sys.exit("RuntimeError: first attempt fails")
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        server.bind(("0.0.0.0", int(port)))
        server.listen()
        conn, _ = server.accept()
        print("worker:1 got", conn.recv(100).decode(), flush=True)
    else:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=2) as conn:
                    conn.sendall(b"hello over the private loopback")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(*UNPRIVILEGED), reason="unshare(1) cannot map a user here")
def test_an_unprivileged_user_gets_the_private_network_with_restarts_and_held_ports(tmp_path):
    result = _run_as(UNPRIVILEGED, ["--workers", "2", "--max-restarts", "1", "--", sys.executable,
                                    _script(tmp_path, LOOPBACK_PAIR)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attempt 1 of 2 failed: worker:1 exited with code 1" in result.stderr
    runs = [json.loads(m) for m in re.findall(r"^\[worker:\d\] (\{.*\})$", result.stdout, re.M)]
    assert len(runs) == 4
    assert {r["uid"] for r in runs} == {1000}                 # the scripts run as the launcher's user, not root
    assert all(r["interfaces"] == ["lo"] for r in runs)
    assert "[worker:1] worker:1 got hello over the private loopback" in result.stdout
    assert result.stderr.count("private network namespace") == 1 and WARNING not in result.stderr
    _assert_all_gone([p for ps in _pids(result.stderr).values() for p in ps] + _holder(result.stderr))


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(*NO_NAMESPACES), reason="unshare(1) not usable here")
def test_a_default_launch_that_cannot_isolate_says_once_at_start_that_its_servers_are_reachable(tmp_path):
    task = _script(tmp_path, """
        import json, os, sys, time
        print(json.dumps({"netns": os.stat("/proc/self/ns/net").st_ino}), flush=True)
        if os.environ["STRATKIT_RESTART_COUNT"] == "0":    # the first attempt fails: the cluster starts twice
            if json.loads(os.environ["TF_CONFIG"])["task"]["index"]:
                sys.exit(1)
            time.sleep(60)
    """)
    result = _run_as(NO_NAMESPACES, ["--workers", "2", "--max-restarts", "1", "--", sys.executable, task])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(WARNING) == 1, result.stderr    # once, though the cluster started twice
    assert result.stderr.index(WARNING) < result.stderr.index("started: pid")
    warning = result.stderr[result.stderr.index(WARNING):result.stderr.index("started: pid")]
    assert "runs any graph a client sends" in warning and "Fix:" in warning
    assert "user namespaces" in warning and "firewall" in warning and "Operation not permitted" in warning
    netns = {json.loads(m)["netns"] for m in re.findall(r"^\[worker:\d\] (\{.*\})$", result.stdout, re.M)}
    assert netns == {_netns()}                                  # really in the machine's network


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(*NO_NAMESPACES), reason="unshare(1) not usable here")
def test_private_network_where_namespaces_are_refused_fails_saying_why_and_what_to_do(tmp_path):
    result = _run_as(NO_NAMESPACES, ["--workers", "2", "--private-network", "--", sys.executable, "-c", "pass"])
    assert result.returncode == 2, result.stderr
    assert "--private-network" in result.stderr and "Operation not permitted" in result.stderr
    assert "user namespaces" in result.stderr and "Fix:" in result.stderr and "--no-private-network" in result.stderr
    assert "started" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flag", "env"])
def test_opting_out_of_the_private_network_warns_with_the_way_to_close_it(tmp_path, how, monkeypatch):
    task = _script(tmp_path, 'import os; print({"netns": os.stat("/proc/self/ns/net").st_ino})\n')
    if how == "env":
        monkeypatch.setenv("STRATKIT_PRIVATE_NETWORK", "0")
    opt_out = ["--no-private-network"] if how == "flag" else []
    result = _run_as([], ["--workers", "2", *opt_out, "--", sys.executable, task])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(WARNING) == 1
    warning = result.stderr[result.stderr.index(WARNING):result.stderr.index("started: pid")]
    assert "drop --no-private-network" in warning and "firewall" in warning
    assert f"[worker:1] {{'netns': {_netns()}}}" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare("--user", "--map-root-user", "--net"), reason="no user+network namespaces")
def test_a_network_error_in_the_private_network_gets_a_hint_in_the_report(tmp_path):
    # 198.18.0.0/15 is RFC 2544's benchmarking range: in a namespace with only loopback there is no route to
    # it, so connect() fails at once with ENETUNREACH, no name lookup and no packet.
    task = _script(tmp_path, "import socket\nsocket.socket().connect(('198.18.0.250', 443))\n")
    result = _run_as([], ["--workers", "1", "--", sys.executable, task])
    assert result.returncode == 1, result.stderr
    report = result.stderr[result.stderr.index("root cause"):]
    assert "exception: OSError: [Errno 101] Network is unreachable" in report
    assert re.search(r"ran in a private network.*--no-private-network", report, re.S), report


STORE_ON_LOOPBACK = """
import os
os.environ.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                  AWS_DEFAULT_REGION="us-east-1")
from stratkit.data import Table
Table.parquet("s3://lake/events").plan()
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare("--user", "--map-root-user", "--net"), reason="no user+network namespaces")
def test_a_table_on_a_store_the_private_network_cannot_reach_gets_the_hint_in_the_report(tmp_path):
    # A store on this machine's loopback (moto, MinIO) is not on the private network's: pyarrow's S3 client
    # says "Could not connect to server" (curl), which the report did not take for a network error.
    result = _run_as([], ["--workers", "1", "--", sys.executable, _script(tmp_path, STORE_ON_LOOPBACK)], timeout=120)
    assert result.returncode == 1, result.stderr
    report = result.stderr[result.stderr.index("root cause"):]
    assert "ConfigError: table path 's3://lake/events' cannot be read" in report, report
    assert re.search(r"ran in a private network.*--no-private-network", report, re.S), report


SLEEPER = """
    import json, os, subprocess, sys, time
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"ready {task['type']}:{task['index']} grandchild={child.pid}", flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how, user", [("SIGINT", "as is"), ("SIGKILL", "as is"), ("SIGKILL", "unprivileged")])
@pytest.mark.skipif(not _can_unshare(*UNPRIVILEGED), reason="no user namespaces")
def test_stopping_an_isolated_launcher_leaves_no_process_behind(tmp_path, how, user):
    import signal

    launcher = _Launcher(["--workers", "2", "--", sys.executable, _script(tmp_path, SLEEPER)],
                         prefix=tuple(UNPRIVILEGED) if user == "unprivileged" else ())
    try:
        grandchildren = [int(m.group(1)) for m in launcher.wait_for(r"ready \w+:\d+ grandchild=(\d+)", 2)]
        tasks = [p for ps in _pids(launcher.stderr).values() for p in ps]
        (holder,) = _holder(launcher.stderr)
        assert all(_netns(p) == _netns(holder) != _netns() for p in tasks + grandchildren)
        launcher.proc.send_signal(getattr(signal, how))
        code = launcher.finish()
        assert code == (130 if how == "SIGINT" else -9)
        _assert_all_gone(tasks + grandchildren + [holder], within=10)
        assert not _alive(holder)
    finally:
        launcher.kill()
