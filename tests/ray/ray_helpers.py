"""One local Ray per test module, loopback only, token authentication on, and nothing left running after it.

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
import secrets
import signal
import sys
import time
from collections.abc import Iterator
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
    saved = {key: os.environ.get(key) for key in (*RAY_ENV, "RAY_AUTH_TOKEN", "PYTHONPATH")}
    os.environ.update(RAY_ENV)
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
