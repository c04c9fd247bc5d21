"""The Spark modules that run on the same session (master and confs) run next to each other and share it.

A local-cluster session's executors and their Python workers cost 25-50 s to start on a loaded 2-core
machine; spark_helpers.shared_session keeps one session for every module asking for the same one, as long
as no other session starts in between. test_logserver_spark.py sorts before modules that start other
sessions (test_spark_connect.py, test_spark_gpu.py), so its tests move to just before test_spark_runner.py's;
test_spark_ml.py's and test_spark_storage.py's too.
"""

from __future__ import annotations

import pytest
from spark_helpers import stop_shared_session

#: Modules moved to just before the module whose session they share (tests/conftest.py's SAME_SESSION also makes
#: them one xdist work unit, so that one worker runs them all, one after another).
SHARING = {"test_logserver_spark.py": "test_spark_runner.py", "test_spark_ml.py": "test_spark_runner.py",
           "test_spark_tune.py": "test_spark_runner.py",
           "test_spark_storage.py": "test_spark_runner.py", "test_spark_preemption.py": "test_spark_runner.py",
           "test_spark_typed.py": "test_spark_runner.py", "test_spark_lake.py": "test_spark_runner.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for moved, before in SHARING.items():
        group = [item for item in items if item.path.name == moved]
        rest = [item for item in items if item.path.name != moved]
        at = next((n for n, item in enumerate(rest) if item.path.name == before), None)
        if group and at is not None:
            items[:] = rest[:at] + group + rest[at:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the kept session after the last test of the modules sharing it (its executors hold memory)."""
    sharers = set(SHARING) | set(SHARING.values())
    if item.path.name in sharers and (nextitem is None or nextitem.path.name not in sharers):
        stop_shared_session()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_spark_session():
    yield
    stop_shared_session()
