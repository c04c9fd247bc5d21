"""Suite-wide rules: the network guard (tests reach only loopback and their own test hosts).

`tests/netguard/sitecustomize.py` refuses, before the system call, any connect or
name lookup outside 127.0.0.0/8, ::1 and 198.18.0.0/15. This file installs it in
the pytest process, puts its folder first on ``PYTHONPATH`` so every Python
process a test starts is guarded too, and fails the test during which any
process logged a refusal (even one a library swallowed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest

import hosts
from procs import REPO_ROOT, describe, run_process

GUARD_DIR = Path(__file__).resolve().parent / "netguard"


def _load_guard():
    spec = importlib.util.spec_from_file_location("stratkit_tests_netguard", GUARD_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # tests import it by this name (its classes must be the hook's)
    spec.loader.exec_module(module)
    return module


netguard = _load_guard()


LOG: Path | None = None
OWNED = False      # this pytest made the log (a pytest a test starts uses its parent's)


def pytest_unconfigure(config: pytest.Config) -> None:
    if OWNED and LOG is not None:
        LOG.unlink(missing_ok=True)


def pytest_configure(config: pytest.Config) -> None:
    global LOG, OWNED
    if os.environ.get(netguard.LOG_VARIABLE):   # a pytest started by a test: its parent owns the log
        LOG = Path(os.environ[netguard.LOG_VARIABLE])
        return
    handle, log = tempfile.mkstemp(prefix="stratkit-netguard-", suffix=".log")
    os.close(handle)
    LOG, OWNED = Path(log), True
    os.environ[netguard.LOG_VARIABLE] = log
    paths = [str(GUARD_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    netguard.install()


@pytest.fixture(autouse=True)
def _network_rule():
    """Fail the test if any guarded process tried to reach outside loopback and the test hosts."""
    log = LOG
    start = log.stat().st_size if log.exists() else 0
    yield
    if log.exists() and log.stat().st_size > start:
        with open(log) as handle:
            handle.seek(start)
            refused = handle.read().strip()
        pytest.fail(f"traffic outside loopback and the test hosts:\n{refused}", pytrace=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("hosts") is not None:
        hosts.gate()


@pytest.fixture
def make_test_hosts():
    """`make_test_hosts(n, names=True)` -> [Host h1..hn]; all removed, with their processes, after the test."""
    hosts.gate()
    with ExitStack() as stack:
        def make(n: int, names: bool = True) -> list[hosts.Host]:
            return stack.enter_context(hosts.make_hosts(n, names=names))
        yield make


@pytest.fixture
def two_hosts(make_test_hosts) -> list[hosts.Host]:
    """Test hosts h1 (198.18.0.1) and h2 (198.18.0.2), each resolving the other's name."""
    return make_test_hosts(2)


@pytest.fixture(scope="session")
def one_process_uneven() -> dict:
    """What one process trains for parity case `trainer_uneven` (tests/strategy/parity_cases.py): its RESULT.

    Several modules compare a multi-node run (launch --nnodes, Slurm, Spark, test hosts) with this same
    one-process reference; it is deterministic, so the session trains it once instead of once per test.
    """
    one = run_process(str(REPO_ROOT / "tests" / "strategy" / "parity_cases.py"), args=["one", "trainer_uneven"],
                      timeout=240)
    assert one.ok, describe([one])
    line = next(line for line in one.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])["trainer_uneven"]
