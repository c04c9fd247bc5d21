"""The pytest plugin `tools/keras_tests.py` loads (``-p keras_tests_plugin``) into each run of Keras's own tests.

It does three things, nothing else:

* stands in for Keras's own ``conftest.py``, which is not in the wheel: registers its markers and offers
  its ``skip_if_backend`` (a few test files import it), so a Keras test file runs here as in Keras's CI on
  the TensorFlow backend;
* with ``--stratkit-patches``, installs stratkit's Keras patches at configure time, before any test module
  is imported, exactly as ``stratkit.make_strategy()`` does in a user's process
  (``stratkit.strategy.keras_compat.apply()``), and stops the run if they are not really in place;
* writes every test's outcome, as it finishes, to the JSON-lines file ``--keras-tests-record`` names:
  one line a record, written and flushed at once, so a process that crashes or is killed still leaves
  the outcomes of the tests before, and the test it died in (started, never finished).

Record lines (``"event"`` says which): ``start`` (the pass, and the patch status when patched),
``collected`` (every node id that will run), ``collect_error``, ``begin`` (a test started), ``test``
(a test finished: outcome, seconds, the first lines of its failure), ``end`` (pytest's exit status and
whether the patches were still installed at the end).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytest

#: Marks Keras's tests use that its (unshipped) conftest.py registers; on TensorFlow they select nothing.
KERAS_MARKERS = (
    "requires_trainable_backend: Keras's mark for tests that need a backend with a trainer",
    "multi_device: Keras's mark for tests that need several devices",
)
#: How much of a failure the record keeps: its first lines (the report gives the whole).
MESSAGE_LINES = 12
MESSAGE_CHARS = 1500


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("keras_tests", "stratkit: Keras's own tests, plain and patched")
    group.addoption("--stratkit-patches", action="store_true", default=False,
                    help="install stratkit's Keras patches (keras_compat.apply()) before any test runs")
    group.addoption("--keras-tests-record", default=None, metavar="PATH",
                    help="append each test's outcome to this JSON-lines file")


class _Recorder:
    """Per-test outcomes from pytest's setup/call/teardown reports, one JSON line each (a registered plugin)."""

    def __init__(self, path: Path, patched: bool) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._patched = patched
        self._phases: dict[str, dict[str, Any]] = {}

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write({"event": "collect_error", "nodeid": report.nodeid, "message": _message(report)})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.write({"event": "collected", "nodeids": [item.nodeid for item in session.items]})

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._phases[nodeid] = {"started": time.monotonic(), "cpu": _cpu_seconds()}
        self.write({"event": "begin", "nodeid": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = self._phases.setdefault(report.nodeid, {"started": time.monotonic(), "cpu": _cpu_seconds()})
        outcome = _phase_outcome(report)
        if outcome is not None and "outcome" not in state:
            # the first phase that did not pass decides (a teardown error after a failed call stays "failed")
            state["outcome"], state["message"] = outcome, _message(report)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        state = self._phases.pop(nodeid, {"started": time.monotonic(), "cpu": _cpu_seconds()})
        self.write({"event": "test", "nodeid": nodeid, "outcome": state.get("outcome", "passed"),
                    "seconds": round(time.monotonic() - state["started"], 3),
                    "cpu_seconds": round(_cpu_seconds() - state["cpu"], 3),
                    "message": state.get("message", "")})

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        end: dict[str, Any] = {"event": "end", "exitstatus": int(exitstatus),
                               "cpu_seconds": round(_cpu_seconds(), 1)}
        if self._patched:
            end["patches_at_end"] = _patch_status()   # a test that reverted them would have run the rest plain
        self.write(end)
        self._file.close()


def _cpu_seconds() -> float:
    """CPU time of this whole process so far (every thread, TensorFlow's too): a busy machine does not inflate it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _phase_outcome(report: pytest.TestReport) -> str | None:
    """What one phase's report says of the test, or None when the phase passed."""
    xfail = hasattr(report, "wasxfail")
    if report.skipped:
        # pytest reports an xfail as a skipped call carrying ``wasxfail``
        return "xfailed" if xfail else "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.when == "call" and xfail:
        return "xpassed"
    return None


def _message(report: pytest.TestReport) -> str:
    """The first lines of what went wrong: the exception line(s), or a skip's reason."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])            # (path, line, "Skipped: reason")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = f"{crash.message}\n  at {crash.path}:{crash.lineno}" if crash is not None else report.longreprtext
    lines = text.strip().splitlines()[:MESSAGE_LINES]
    return "\n".join(lines)[:MESSAGE_CHARS]


def _patch_status() -> dict[str, Any]:
    """Whether stratkit's patches are in place on the classes every test uses (read, not assumed)."""
    from stratkit.strategy import keras_compat
    from stratkit.strategy.keras_compat import global_gradient, trainer_patches
    from stratkit.strategy.keras_compat.versions import _PATCH_MARK

    trainer = trainer_patches._trainer_module().TensorFlowTrainer
    return {"fit_guard": bool(getattr(trainer.__dict__.get("fit"), _PATCH_MARK, False)),
            "trainer_fixes": bool(keras_compat._originals),
            "global_gradient": global_gradient.installed()}


def _install_patches() -> dict[str, Any]:
    import stratkit
    from stratkit.strategy import keras_compat

    status = keras_compat.apply()
    installed = _patch_status()
    if status != "patched" or not all(installed.values()):
        raise pytest.UsageError(
            f"--stratkit-patches: stratkit's Keras patches are not in place (keras_compat.apply() returned "
            f"{status!r}, installed: {installed}). The patched pass would test plain Keras. Fix: run it on a "
            f"tested Keras ({sorted(keras_compat.TESTED_KERAS_VERSIONS)}) without STRATKIT_KERAS_COMPAT set, "
            f"with KERAS_BACKEND=tensorflow")
    return {"status": status, "keras": keras_compat.installed_keras_version(),
            "stratkit": str(Path(stratkit.__file__).parent), **installed}


def skip_if_backend(given_backend: str, reason: str) -> pytest.MarkDecorator:
    """What a few Keras test files import from Keras's conftest.py: skip a test on one backend."""
    import keras

    return pytest.mark.skipif(keras.backend.backend() == given_backend, reason=reason)


def pytest_configure(config: pytest.Config) -> None:
    # `from conftest import skip_if_backend` in Keras's test files finds it here (Keras's conftest.py is
    # not in the wheel)
    sys.modules.setdefault("conftest", sys.modules[__name__])
    for line in KERAS_MARKERS:
        config.addinivalue_line("markers", line)
    patched = config.getoption("stratkit_patches")
    patches = _install_patches() if patched else None     # before collection imports any test module
    path = config.getoption("keras_tests_record")
    if path:
        recorder = _Recorder(Path(path), patched)
        recorder.write({"event": "start", "pass": "patched" if patched else "plain", "patches": patches})
        config.pluginmanager.register(recorder, "keras_tests_recorder")
