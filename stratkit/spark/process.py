"""Start one training process, stream its output line by line, and kill its whole tree when told.

Shared by the executor tasks and by `MirroredStrategyRunner(local_mode=True)`
on the driver.

A process is started in two steps, so the slow part of its start (importing
TensorFlow and Keras, seconds) overlaps with work the task must do anyway:
  1. `TrainingProcess.spawn(env)`: a new interpreter starts and, with
     `preload`, imports TensorFlow and Keras -- but creates no TensorFlow
     context, server or device, so TF_CONFIG and CUDA_VISIBLE_DEVICES given in
     step 2 still take effect (TensorFlow reads them when its context starts);
  2. `start(workdir, env, on_line)`: the task hands it the run's complete
     environment and working directory (one JSON line on its stdin), and
     `stream()` forwards its output until it exits.
A spawned, unstarted process is what a warm standby is (`stratkit.spark.task`).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from stratkit import tf_logging
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


def spawn_env(env: Mapping[str, str], run: bool = False) -> dict[str, str]:
    """`env` plus what every training process needs; without `run`, also minus the run's TF_CONFIG."""
    env = dict(env)
    env.update(tf_logging.quiet_defaults(env))  # the user's own setting wins
    env[child_module.PARENT_VAR] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = python_path()
    env.pop("PYTHON_WORKER_FACTORY_SECRET", None)  # Spark's worker secret is not the user's business
    if not run:
        env.pop("TF_CONFIG", None)  # given in start(): a standby serves whichever run comes next
    return env


class TrainingProcess:
    """`stratkit.spark.child.main` in a new interpreter, in its own session (process group).

    `TrainingProcess(workdir, env, on_line)` spawns and starts at once;
    `TrainingProcess.spawn(env)` then `start(...)` splits the two.

    Args:
        workdir: holds payload.pkl (and result.pkl afterwards).
        env: the complete environment of the process.
        on_line: called with every output line (stdout and stderr merged, in order).
    """

    def __init__(self, workdir: str, env: Mapping[str, str], on_line: Callable[[str], None]) -> None:
        self._spawn(env, preload=False)
        self.start(workdir, env, on_line)

    @classmethod
    def spawn(cls, env: Mapping[str, str], preload: bool = True) -> TrainingProcess:
        """Start the interpreter (importing TensorFlow and Keras when `preload`); it waits for `start`."""
        process = cls.__new__(cls)
        process._spawn(env, preload)
        return process

    def _spawn(self, env: Mapping[str, str], preload: bool) -> None:
        self.workdir = ""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._on_line: Callable[[str], None] = lambda text: None
        self._noise = tf_logging.StartupNoise(env)
        self.killed_because: str | None = None
        self._lock = threading.Lock()
        self.started = False
        self.env = spawn_env(env)
        if preload:
            self.env[child_module.PRELOAD_VAR] = "1"
        # `-c` rather than `-m stratkit.spark.child`: runpy warns when the package already imported the module.
        self.spawned_at = time.time()
        self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, workdir: str, env: Mapping[str, str], on_line: Callable[[str], None]) -> None:
        """Hand the process its run: the working directory and the complete environment."""
        full = spawn_env(env, run=True)
        full[child_module.PARENT_VAR] = self.env[child_module.PARENT_VAR]
        self.workdir = workdir
        self._on_line = on_line
        self._noise = tf_logging.StartupNoise(full)
        self.started = True
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"workdir": workdir, "env": full}) + "\n").encode())
            self.proc.stdin.close()
        except OSError:  # it died while waiting (stream() reports its exit code and output)
            pass

    def stream(self, on_started: Callable[[], None] | None = None) -> int:
        """Forward every line until the process ends; returns its exit code (negative: killed by a signal).

        `on_started` is called (in this thread) when train_fn is about to start: the process's own
        TensorFlow import is over, so a next process can import without competing with it.
        """
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            if text == child_module.STARTED_LINE:
                if on_started is not None:
                    on_started()
                continue
            if not self._noise.keep(text):
                continue
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
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
