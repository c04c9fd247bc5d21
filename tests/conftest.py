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

import cpu_times
import hosts
from procs import REPO_ROOT, describe, run_process, stop_fork_servers

GUARD_DIR = Path(__file__).resolve().parent / "netguard"


def _load_guard():
    loaded = sys.modules.get("sitecustomize")
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() == GUARD_DIR / "sitecustomize.py":
        # this pytest started with the guard on PYTHONPATH (an xdist worker): its hook is that module's
        sys.modules["stratkit_tests_netguard"] = loaded
        return loaded
    spec = importlib.util.spec_from_file_location("stratkit_tests_netguard", GUARD_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # tests import it by this name (its classes must be the hook's)
    spec.loader.exec_module(module)
    return module


netguard = _load_guard()


LOG: Path | None = None
OWNED = False      # this pytest made the log (a pytest a test starts uses its parent's)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_fork_servers()
    if OWNED and LOG is not None:
        LOG.unlink(missing_ok=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    cpu_times.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    global LOG, OWNED
    cpu_times.configure(config)     # `--times PATH`: each test's wall and CPU time (tests/cpu_times.py)
    # gcsfs reads this once, at import: its bucket-type probe speaks gRPC, which the GCS emulator
    # (tests/stores.py) does not, so it is off for the whole suite and every process it starts.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if os.environ.get(netguard.LOG_VARIABLE):   # a pytest started by a test: its parent owns the log
        LOG = Path(os.environ[netguard.LOG_VARIABLE])
        return
    handle, log = tempfile.mkstemp(prefix="stratkit-netguard-", suffix=".log")
    os.close(handle)
    LOG, OWNED = Path(log), True
    os.environ[netguard.LOG_VARIABLE] = log
    paths = [str(GUARD_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    # MLflow sends usage telemetry to its own servers unless told not to (it decides when it is imported):
    # here and in every process the tests start.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
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


@pytest.fixture(autouse=True)
def _mlflow_environment():
    """MLflow's fluent calls in a test's own process write the environment (`set_experiment` sets
    MLFLOW_EXPERIMENT_ID, `set_tracking_uri` MLFLOW_TRACKING_URI) so that subprocesses inherit them: restored after
    each test. Left, the experiment id of one test's server went to a later test's searches in the same xdist worker,
    whose server has no such experiment (their runs were never logged)."""
    saved = {key: value for key, value in os.environ.items() if key.startswith("MLFLOW_")}
    yield
    for key in [key for key in os.environ if key.startswith("MLFLOW_") and key not in saved]:
        del os.environ[key]
    os.environ.update(saved)


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
def store_server():
    """`store_server(scheme)` -> a running `tests/stores.py` server ("s3", "gs", "az"), one per session and scheme.

    A test that takes it down (`server.down()`) brings it back up before it ends."""
    import stores

    started: dict = {}

    def get(scheme: str):
        stores.gate(scheme)
        if scheme not in started:
            started[scheme] = stores.SERVERS[scheme]().start()
        server = started[scheme]
        server.up()
        return server

    yield get
    for server in started.values():
        server.stop()


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


# ---------------------------------------------------------------------------------------------
# `make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadfile`): a module runs whole in
# one worker, so its module fixtures (a parity run, a Spark session) are made once. A worker takes the
# next module when it is nearly done with its own; the longest modules go first so that neither worker
# is left with a long one at the end while the other idles (longest-first scheduling).

#: The longest modules, longest first (module totals of a full run, tests/ timings in the CI log).
LONGEST_FIRST = (
    "tests/training/test_trainer_multiworker.py",
    "tests/strategy/test_global_gradient.py",
    "tests/training/test_step_backups.py",
    "tests/training/test_remote_backups.py",
    "tests/strategy/test_model_fit_path.py",
    "tests/launch/test_nnodes.py",
    "tests/test_spark_hosts.py",
    "tests/benchmarks/test_benchmarks_smoke.py",
    "tests/test_slurm_hosts.py",
    "tests/training/test_tracking.py",
    "tests/training/test_step_resume_inputs.py",
    "tests/launch/test_nnodes_preemption.py",
    "tests/launch/test_launch_preemption.py",
    "tests/spark/test_spark_preemption.py",
    "tests/examples/test_tutorials.py",
    "tests/tuning/test_keras_tuner.py",
    "tests/tuning/test_tracking_search.py",
    "tests/spark/test_spark_runner.py",
    "tests/spark/test_spark_ml.py",
    "tests/spark/test_spark_typed.py",
    "tests/training/test_parameter_server.py",
    "tests/test_spark_elastic_hosts.py",
    "tests/spark/test_spark_runs.py",
    "tests/training/test_compression_multiworker.py",
    "tests/launch/test_elastic.py",
    "tests/launch/test_launch.py",
    "tests/spark/test_spark_gpu.py",
    "tests/spark/test_pipeline_job.py",
    "tests/training/test_trainer_fit_args.py",
    "tests/strategy/test_compression.py",
    "tests/examples/test_examples.py",
    "tests/strategy/test_custom_loop.py",
    "tests/storage/test_store_paths_multiworker.py",
    "tests/storage/test_store_urls_one_process.py",
)


#: Modules on one kept Spark session (tests/spark/spark_helpers.py `shared_session`, tests/spark/conftest.py
#: SHARING): one xdist work unit, so one worker runs them one after another and starts the session (its driver,
#: two executor JVMs and their standbys, each importing TensorFlow) once. As separate modules they went to
#: either worker, and any other session in between stopped the kept one.
SAME_SESSION = frozenset({"tests/spark/test_spark_runner.py", "tests/spark/test_logserver_spark.py",
                          "tests/spark/test_spark_ml.py", "tests/spark/test_spark_storage.py",
                          "tests/spark/test_spark_preemption.py", "tests/spark/test_spark_typed.py",
                          "tests/spark/test_spark_lake.py", "tests/spark/test_spark_tune.py"})


#: The Ray engine's modules: one work unit, first (the longest), so `make test-cluster` runs them one after another
#: in one worker while the other runs the test-host modules. Two local Ray sessions side by side each look for
#: cloud metadata (which the network guard refuses) and see "multiple active Ray instances".
RAY_MODULES = "tests/ray/"


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with the SAME_SESSION modules as one work unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            if module.startswith(RAY_MODULES):
                return "tests/ray (one Ray at a time)"
            return "tests/spark (one shared session)" if module in SAME_SESSION else module

    return Scheduling(config, log)


@pytest.hookimpl(tryfirst=True)     # before tests/spark/conftest.py moves its session sharers together
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return                      # a serial run keeps the collection order
    rank = {module: n for n, module in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        module = item.path.relative_to(config.rootpath).as_posix()
        return -1 if module.startswith(RAY_MODULES) else rank.get(module, len(rank))

    items.sort(key=order)
