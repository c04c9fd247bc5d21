"""Where a test run's time goes: each test's wall time and CPU time with its children's (``pytest --times PATH``).

Off unless ``--times PATH`` is given (``make test TEST_TIMES=out/test-times.json``). Then, per test (its setup,
call and teardown, so a module fixture counts in the test that made it):

- ``wall``: seconds from the start of its setup to the end of its teardown;
- ``cpu_self``: the pytest process's own CPU (``RUSAGE_SELF``);
- ``cpu_waited``: CPU of its children that were waited for (``RUSAGE_CHILDREN``: a child's, and of whatever it
  waited for, counted when it is reaped);
- ``cpu_tree``: ``cpu_self + cpu_waited`` + the change in the CPU of the live descendants (their own and their
  reaped children's, from /proc): the CPU of a Spark JVM or a server a session fixture started, while it runs,
  counts in the test during which it was spent. What it still misses: a descendant that was orphaned (its parent
  gone without waiting) and then ended, reaped by init: its CPU after the last look is lost;
- ``cpu_cgroup``: when this process can make a cgroup (root, a writable cpuacct or cgroup v2 hierarchy), each
  pytest worker runs in a cgroup of its own and this is its CPU counter's change: every process it started,
  orphans included, exactly.

Processes that import TensorFlow or Keras are counted too (``tests/netguard/stratkit_import_probe.py``: one
line per import, with the test that ran it), and the children `tests/procs.py` forked from its fork server
(which import nothing). The controller writes PATH (JSON): the run (wall, load averages
every 15 s, the machine's busy CPU), every test, totals per module, and the imports (while it runs, each test's
line is appended to PATH.partial). `tools/test_times.py PATH` prints the tables.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

IMPORT_LOG = "STRATKIT_TEST_IMPORT_LOG"
_TICK = os.sysconf("SC_CLK_TCK")


def addoption(parser: pytest.Parser) -> None:
    parser.addoption("--times", metavar="PATH", default=None,
                     help="write each test's wall and CPU time (with its children's) to PATH (JSON; tests/cpu_times.py)")


def configure(config: pytest.Config) -> None:
    """Register the recorder (in every pytest process: an xdist controller collects, its workers measure)."""
    path = config.getoption("times", None)
    if not path:
        return
    worker = hasattr(config, "workerinput")
    if not worker and not os.environ.get(IMPORT_LOG):
        handle, log = tempfile.mkstemp(prefix="stratkit-imports-", suffix=".jsonl")
        os.close(handle)
        os.environ[IMPORT_LOG] = log   # before xdist starts its workers: they and every child log imports
    config.pluginmanager.register(Recorder(config, Path(path), worker), "stratkit-cpu-times")


def _rusage(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _descendants_cpu(root: int) -> float:
    """CPU seconds of the live descendants of `root` (each its own plus its reaped children's)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = sum(int(f) for f in fields[11:15]) / _TICK   # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        total += cpu[pid]
        todo.extend(children.get(pid, ()))
    return total


class _Cgroup:
    """A cgroup of this process's own with a CPU counter (cgroup v1 cpuacct or v2), if it can make one."""

    def __init__(self, name: str) -> None:
        self.path: Path | None = None
        self.home: Path | None = None
        self.counter = ""
        for base, counter in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"), (Path("/sys/fs/cgroup"), "cpu.stat")):
            if not (base / counter).exists() or not os.access(base / "cgroup.procs", os.W_OK):
                continue
            try:
                path = base / name
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                continue
            self.path, self.home, self.counter = path, base, counter
            return

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        try:
            text = (self.path / self.counter).read_text()
        except OSError:
            return None
        if self.counter == "cpuacct.usage":
            return int(text) / 1e9
        return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("usage_usec")) / 1e6

    def leave(self) -> list[int]:
        """Back to the root group; the group is removed unless a process is still in it (their PIDs: strays)."""
        if self.path is None:
            return []
        try:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            left = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not left:
                self.path.rmdir()
            return left
        except OSError:
            return []


class Recorder:
    def __init__(self, config: pytest.Config, path: Path, worker: bool) -> None:
        self.config, self.path, self.worker = config, path, worker
        self.name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.tests: list[dict] = []
        self.outcomes: dict[str, str] = {}
        self.cgroup = _Cgroup(f"stratkit-tests-{os.getpid()}") if worker or not self._distributed() else None
        self.start = None
        self.started_wall = time.time()
        self.partial = path.with_name(path.name + ".partial")
        if not worker:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.partial.unlink(missing_ok=True)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        if not worker:
            threading.Thread(target=self._sample, name="cpu-times-load", daemon=True).start()

    def _distributed(self) -> bool:
        return bool(getattr(self.config.option, "numprocesses", None))

    # --- measuring (a worker, or a run without xdist) ------------------------------------------------------
    def _snapshot(self) -> dict:
        return {"wall": time.monotonic(), "self": _rusage(resource.RUSAGE_SELF),
                "waited": _rusage(resource.RUSAGE_CHILDREN), "live": _descendants_cpu(os.getpid()),
                "cgroup": self.cgroup.seconds() if self.cgroup else None, "at": time.time()}

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        item.stash[_START] = self._snapshot()
        yield

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem):
        yield
        start = item.stash.get(_START, None)
        if start is None:
            return
        end = self._snapshot()
        cpu_self, waited = end["self"] - start["self"], end["waited"] - start["waited"]
        record = {"wall": end["wall"] - start["wall"], "cpu_self": cpu_self, "cpu_waited": waited,
                  "cpu_tree": cpu_self + waited + end["live"] - start["live"],
                  "cpu_cgroup": (end["cgroup"] - start["cgroup"]) if start["cgroup"] is not None else None,
                  "start": start["at"], "worker": self.name, "load1": os.getloadavg()[0]}
        item.user_properties.append(("cpu_times", {k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in record.items()}))

    # --- collecting (the controller, or a run without xdist) -----------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        if report.when == "call" or report.outcome != "passed":
            if self.outcomes.get(report.nodeid) in (None, "passed"):
                self.outcomes[report.nodeid] = report.outcome
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == "cpu_times":
                self.tests.append({"nodeid": report.nodeid, **value})
                with open(self.partial, "a") as handle:    # to follow a long run while it runs
                    handle.write(json.dumps(self.tests[-1]) + "\n")

    def _sample(self) -> None:
        previous = _busy()
        while True:
            load = os.getloadavg()
            now = _busy()
            busy = (now[0] - previous[0]) / max(now[1] - previous[1], 1) if previous and now else None
            previous = now
            self.samples.append({"at": round(time.time(), 1), "load1": load[0], "load5": load[1],
                                 "machine_busy": round(busy, 3) if busy is not None else None})
            if self._stop.wait(15):
                return

    @pytest.hookimpl(trylast=True)     # after tests/conftest.py ended the fork servers
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        strays = self.cgroup.leave() if self.cgroup else []
        if strays:
            sys.stderr.write(f"cpu_times: processes left in the worker's cgroup after the run: {strays}\n")
        if self.worker:
            return
        self._stop.set()
        for test in self.tests:
            test["outcome"] = self.outcomes.get(test["nodeid"], "?")
        lines = _read_imports(os.environ.get(IMPORT_LOG))
        imports = [line for line in lines if "module" in line]
        forks = [line for line in lines if line.get("forked")]
        modules: dict[str, dict] = {}
        for test in self.tests:
            module = modules.setdefault(test["nodeid"].split("::", 1)[0], {
                "tests": 0, "wall": 0.0, "cpu_self": 0.0, "cpu_waited": 0.0, "cpu_tree": 0.0, "cpu_cgroup": 0.0,
                "tf_imports": 0, "tf_import_cpu": 0.0, "forked": 0})
            module["tests"] += 1
            for key in ("wall", "cpu_self", "cpu_waited", "cpu_tree", "cpu_cgroup"):
                module[key] = round(module[key] + (test[key] or 0.0), 3)
        for line in lines:
            module = modules.get(line["test"].split("::", 1)[0]) if line.get("test") else None
            if module is None or line.get("started"):
                continue
            if line.get("forked"):
                module["forked"] += 1
            else:
                module["tf_imports"] += 1
                module["tf_import_cpu"] = round(module["tf_import_cpu"] + line["cpu"], 3)
        run = {"started": self.started_wall, "wall": round(time.time() - self.started_wall, 1),
               "args": sys.argv[1:], "load": self.samples, "tests": len(self.tests),
               "tf_imports": len(imports), "forked": len(forks), "tf_import_cpu": round(sum(line["cpu"] for line in imports), 1),
               "tf_import_wall": round(sum(line["wall"] for line in imports), 1)}
        for key in ("wall", "cpu_self", "cpu_waited", "cpu_tree", "cpu_cgroup"):
            run["sum_" + key] = round(sum(test[key] or 0.0 for test in self.tests), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"run": run, "modules": modules, "tests": self.tests, "imports": lines},
                                        indent=1))
        self.partial.unlink(missing_ok=True)
        log = os.environ.pop(IMPORT_LOG, None)
        if log:
            Path(log).unlink(missing_ok=True)


_START = pytest.StashKey[dict]()


def _busy() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine (/proc/stat), for the other load beside the run."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(f) for f in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _read_imports(log: str | None) -> list[dict]:
    if not log or not os.path.exists(log):
        return []
    out = []
    with open(log) as handle:
        for line in handle:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass    # a process killed in the middle of its line
    return out
