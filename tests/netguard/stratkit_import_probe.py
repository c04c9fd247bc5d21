"""In a measuring test run only: which processes import TensorFlow/Keras, for whom, and what it costs them.

`tests/cpu_times.py` (``pytest --times PATH``) sets ``STRATKIT_TEST_IMPORT_LOG`` to a file; every Python
process a test then starts imports this module from the network guard's ``sitecustomize`` (children get the
variable with the rest of the environment). It times the import of `tensorflow` and `keras` -- wall and this
process's CPU, the outermost of the two inclusive -- and appends one JSON line per import to the file: pid,
parent, the test that was running (``PYTEST_CURRENT_TEST``, which pytest sets and children inherit), the xdist
worker and the command. A process forked from one that already imported them (a standby, a fork server)
imports nothing and writes nothing: the lines count the imports paid for, not the processes.

Not loaded at all without the variable: test processes stay what users' processes are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

LOG_VARIABLE = "STRATKIT_TEST_IMPORT_LOG"
WATCHED = ("tensorflow", "keras")

_depth = 0


class _TimingLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        global _depth
        module.__loader__ = self.real          # what the module would have had (as if never wrapped)
        module.__spec__.loader = self.real
        _depth += 1
        wall, cpu = time.monotonic(), time.process_time()
        try:
            self.real.exec_module(module)
        finally:
            _depth -= 1
            if _depth == 0:
                _record(module.__name__, time.monotonic() - wall, time.process_time() - cpu)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _TimingLoader(spec.loader)
        return spec


def _record(name: str, wall: float, cpu: float) -> None:
    line = {"pid": os.getpid(), "ppid": os.getppid(), "module": name, "wall": round(wall, 3), "cpu": round(cpu, 3),
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "argv": [os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:3])],
            "loaded": [m for m in WATCHED if m in sys.modules], "time": time.time()}
    try:
        with open(os.environ[LOG_VARIABLE], "a") as handle:   # one short write: lines of processes stay whole
            handle.write(json.dumps(line) + "\n")
    except (OSError, KeyError):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
