"""Start one training process, stream its output line by line, and kill its whole tree when told.

Shared by the executor tasks and by `MirroredStrategyRunner(local_mode=True)`
on the driver.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

from stratkit.spark import child as child_module
from stratkit.spark.logserver import TAIL_LINES


def python_path() -> str:
    """PYTHONPATH for the child: this interpreter's sys.path.

    A Spark Python worker imports from what Spark put on its path (pyspark's
    zips, --py-files, SparkFiles); the child must import the same modules
    (stratkit, the user's train_fn module).
    """
    entries = [p for p in sys.path if p]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(dict.fromkeys(entries))


_ENTRY = "import sys; from stratkit.spark.child import main; sys.exit(main(sys.argv))"


class TrainingProcess:
    """`stratkit.spark.child.main` in a new interpreter, in its own session (process group).

    Args:
        workdir: holds payload.pkl (and result.pkl afterwards).
        env: the complete environment of the process.
        on_line: called with every output line (stdout and stderr merged, in order).
    """

    def __init__(self, workdir: str, env: Mapping[str, str], on_line: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._on_line = on_line
        self.killed_because: str | None = None
        self._lock = threading.Lock()
        env = dict(env)
        env[child_module.PARENT_VAR] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = python_path()
        env.pop("PYTHON_WORKER_FACTORY_SECRET", None)  # Spark's worker secret is not the user's business
        # `-c` rather than `-m stratkit.spark.child`: runpy warns when the package already imported the module.
        self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY, workdir], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stream(self) -> int:
        """Forward every line until the process ends; returns its exit code (negative: killed by a signal)."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(text)
            self._on_line(text)
        return self.proc.wait()

    def kill(self, reason: str) -> None:
        """SIGKILL the process group (the process and anything it started); idempotent, thread-safe."""
        with self._lock:
            if self.killed_because is None and self.proc.poll() is None:
                self.killed_because = reason
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def result_path(self) -> str:
        return os.path.join(self.workdir, child_module.RESULT)

    def close(self) -> None:
        """Kill whatever is left of the tree and reap the process."""
        self.kill("cleanup")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
