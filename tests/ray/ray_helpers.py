"""One local Ray per test module, loopback only, token authentication on, and nothing left running after it;
and a two-node Ray cluster on test hosts (`ray_on_hosts`) with the lines of its driver (`Lines`).

`local_ray()` is the body of the module fixtures in tests/ray/: `ray.init` on
127.0.0.1 with 4 logical CPUs, no dashboard, no usage reporting, a fresh
token (`RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN`, so nothing is written to
~/.ray), and, after `ray.shutdown()`, a check that every process the session
started is gone (they are its children: raylet, GCS, workers).

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes a Ray worker answer
`ray.util.get_node_ip_address()` with loopback instead of asking the routing
table for the machine's LAN address (Ray Train writes that address into
TF_CONFIG; the tests' network rule allows only loopback and test hosts).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from procs import REPO_ROOT

#: Ray reads RAY_AUTH_MODE once, when it is imported: so the tests find Ray without importing it.
# CI installs Ray (Makefile): there a missing Ray fails the tests instead of skipping them.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
                               reason='needs pip install "stratkit[ray]"')

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CUDA_VISIBLE_DEVICES": "",
}


#: One token per pytest process: Ray's driver loads its token once.
TOKEN = secrets.token_hex(32)
_imported = False


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in (b"Z", b"X"):
            parents.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextmanager
def local_ray(num_cpus: int = 4, num_gpus: int = 0) -> Iterator[object]:
    """A local Ray; with `num_gpus`, that many logical GPUs (none exist here): Ray checks them against
    CUDA_VISIBLE_DEVICES, set to "0,...", and assigns their ids to actors that ask for GPUs as their
    CUDA_VISIBLE_DEVICES, which is what the runner reads (TensorFlow sees no GPU). A task or actor that
    asks for none sees the node's "0,..." (Ray leaves it): only for tests that start no TensorFlow."""
    global _imported
    assert _imported or "ray" not in sys.modules, \
        "Ray was imported before its environment was set (it reads RAY_AUTH_MODE then)"
    saved = {key: os.environ.get(key) for key in (*RAY_ENV, *NO_REACH_OUT, "RAY_AUTH_TOKEN", "PYTHONPATH")}
    os.environ.update(RAY_ENV)
    os.environ.update(NO_REACH_OUT)
    if num_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(num_gpus)))
    os.environ["RAY_AUTH_TOKEN"] = TOKEN
    # Ray's workers must import this checkout's stratkit (and the network guard, first on PYTHONPATH).
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([str(REPO_ROOT)] if str(REPO_ROOT) not in paths else []))
    before = set(children_of(os.getpid()))
    import ray

    _imported = True
    try:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True, configure_logging=False)
        yield ray
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 30
        left = [p for p in children_of(os.getpid()) if p not in before]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in children_of(os.getpid()) if p not in before]
        for pid in left:  # a test must not leave Ray behind, even when Ray's shutdown did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not left, f"processes left running after ray.shutdown(): {left}"


#: The `ray` command of the venv that runs the tests, and the head's GCS port on test host h1.
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT = 6380


#: Ray's dashboard process (started by `ray.init()` too, minimal without the dashboard) probes cloud metadata
#: (169.254.169.254, metadata.google.internal) at its start, whatever RAY_USAGE_STATS_ENABLED says (Ray 2.60:
#: `usage_lib.get_cluster_config_to_report`). Its HTTP goes through `requests`, which honours these: a loopback
#: port where nothing listens, so nothing leaves. Refused by the network guard instead, the probe was charged to
#: whichever test ran at that moment, in any xdist worker (the guard's log is the session's).
NO_REACH_OUT = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                "NO_PROXY": "127.0.0.1,localhost,::1"}


def hosts_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `ray start` and the driver on test hosts: token auth, this checkout first."""
    env = dict(os.environ)
    env.update({k: v for k, v in RAY_ENV.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"})
    env["RAY_AUTH_TOKEN"] = TOKEN
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(REPO_ROOT), str(REPO_ROOT / "tests")])
    env["PYTHONUNBUFFERED"] = "1"
    # `ray start --head` always starts Ray's dashboard process (minimal with --include-dashboard=false), and in
    # Ray 2.60 it probes cloud metadata (169.254.169.254, metadata.google.internal) and, with usage stats off,
    # still sends a "disabled" report to usage-stats.ray.io. Its HTTP goes through `requests`, which honours
    # these: a loopback port where nothing listens, so nothing leaves (the tests' network rule checks it).
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"
    env["NO_PROXY"] = "127.0.0.1,localhost,198.18.0.1,198.18.0.2,h1,h2"
    env.update(extra or {})
    return env


@contextmanager
def ray_on_hosts(h1: object, h2: object, env: dict[str, str]) -> Iterator[str]:
    """A Ray head on test host h1 (198.18.0.1) and a second node on h2, 2 CPUs each, no dashboard; yields the
    head's address. Leaving, every process on both hosts is killed rather than `ray stop`ped: `ray stop` finds
    Ray's processes by name on the whole machine, so it would stop another test's Ray (or a developer's) too."""
    # Ray's Unix sockets live under its temp dir: a pytest tmp_path is too long for them (107 bytes).
    temp = tempfile.mkdtemp(prefix="skray-")
    common = ["--num-cpus=2", "--disable-usage-stats", "--num-gpus=0", f"--temp-dir={temp}"]
    try:
        head = h1.run([RAY, "start", "--head", "--node-ip-address=198.18.0.1", f"--port={PORT}",
                       "--include-dashboard=false", *common], timeout=180, env=env)
        assert head.returncode == 0, head.stdout[-3000:]
        node = h2.run([RAY, "start", f"--address=198.18.0.1:{PORT}", "--node-ip-address=198.18.0.2", *common],
                      timeout=180, env=env)
        assert node.returncode == 0, node.stdout[-3000:]
        yield f"198.18.0.1:{PORT}"
    finally:
        for host in (h2, h1):
            host.kill_all(rounds=20)
        shutil.rmtree(temp, ignore_errors=True)


class Lines:
    """A process's output lines, read by a thread; `next` waits for one until a deadline (no sleeps)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self.arrived: list[float] = []  # time.time() at which each line of `seen` was read
        self._queue: queue.Queue[tuple[str, float] | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                self._queue.put((line.rstrip("\n"), time.time()))
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, deadline: float) -> str:
        """The next line; AssertionError (with the last lines) when the process ended or the deadline passed."""
        try:
            item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            raise AssertionError("no line before the deadline:\n" + self.tail()) from None
        if item is None:
            self._queue.put(None)  # it stays ended for the next call
            raise AssertionError("the driver ended early:\n" + self.tail())
        self.seen.append(item[0])
        self.arrived.append(item[1])
        return item[0]

    def when(self, text: str) -> float | None:
        """When the first line containing `text` was read (time.time()), or None."""
        return next((t for line, t in zip(self.seen, self.arrived) if text in line), None)

    def until(self, wanted: Callable[[str], bool], deadline: float) -> str:
        """The first line from now on for which `wanted(line)` is true."""
        while True:
            line = self.next(deadline)
            if wanted(line):
                return line

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.seen[-n:])
