"""A Spark task's training processes: the standby that forks them, and one run's process, followed to its end.

Shared by the executor tasks and by `MirroredStrategyRunner(local_mode=True)`
on the driver.

Two steps, so the slow part of a start (importing TensorFlow and Keras,
seconds) is paid once per Spark Python worker, not once per run:
  1. `Standby.spawn(env)`: a new interpreter (`stratkit.spark.child.main`,
     started with `stratkit.process.children.start_child`: its own process
     group, dying with this process) imports TensorFlow and Keras -- but
     creates no TensorFlow context, server or device;
  2. `standby.start(workdir, env, on_line)`: the run's environment goes to
     `workdir/run.json`, and the standby forks the run's `TrainingProcess`
     (a fresh process: no TensorFlow state, the run's TF_CONFIG and
     CUDA_VISIBLE_DEVICES), its stdout and stderr on a pipe that
     `stream()` follows with `stratkit.process.pump.OutputPump` until it
     exits. A standby serves any number of runs, one at a time.
The executor's warm standby (`stratkit.spark.task`) is a `Standby` kept
between runs; a run started while its standby still imports simply waits.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from stratkit import tf_logging
from stratkit.process.children import kill_group, start_server
from stratkit.process.pump import OutputPump
from stratkit.spark import child as child_module


def python_path() -> str:
    """PYTHONPATH for the standby: this interpreter's sys.path.

    A Spark Python worker imports from what Spark put on its path (pyspark's
    zips, --py-files, SparkFiles); the training process must import the same
    modules (stratkit, the user's train_fn module).
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
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = python_path()
    env.pop("PYTHON_WORKER_FACTORY_SECRET", None)  # Spark's worker secret is not the user's business
    if not run:
        env.pop("TF_CONFIG", None)  # given in start(): a standby serves whichever run comes next
    return env


class Standby:
    """An interpreter with TensorFlow and Keras imported (with `preload`) that forks one process per run.

    Use `Standby.spawn(env)`; `close()` ends it (a run it forked dies with it).
    """

    def __init__(self, env: Mapping[str, str], preload: bool) -> None:
        env = spawn_env(env)
        if preload:
            env[child_module.PRELOAD_VAR] = "1"
        self.env = env
        self.spawned_at = time.time()
        self.proc, self._channel = start_server(_ENTRY, [sys.executable], env)

    @classmethod
    def spawn(cls, env: Mapping[str, str], preload: bool = True) -> Standby:
        """Start the interpreter (it imports TensorFlow and Keras when `preload`); it waits for `start`."""
        return cls(env, preload)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, workdir: str, env: Mapping[str, str], on_line: Callable[[str], None]) -> TrainingProcess:
        """Fork a training process for this run: working directory `workdir`, environment `env`."""
        return TrainingProcess(workdir, env, on_line, standby=self)

    def request_run(self, workdir: str, output_fd: int) -> None:
        message = json.dumps({"workdir": workdir}).encode()
        socket.send_fds(self._channel, [message], [output_fd])

    def next_reply(self) -> dict[str, Any] | None:
        """The standby's next reply, or None once it is gone."""
        try:
            data = self._channel.recv(child_module.MESSAGE_BYTES)
        except OSError:
            return None
        return json.loads(data) if data else None

    def kill(self) -> None:
        kill_group(self.proc.pid)

    def close(self) -> None:
        """End the standby (and any run it still has: they die with it) and reap it."""
        try:
            self._channel.close()
        except OSError:
            pass
        self.kill()
        self.proc.wait()


class TrainingProcess:
    """One run's training process, forked by a `Standby`, in its own process group.

    `TrainingProcess(workdir, env, on_line)` without a standby spawns its own
    (no preload) and ends it on `close()`.

    Args:
        workdir: holds payload.pkl (and result.pkl afterwards); run.json is written here.
        env: the complete environment of the process.
        on_line: called with every output line (stdout and stderr merged, in order).
        standby: the standby to fork from.
    """

    def __init__(self, workdir: str, env: Mapping[str, str], on_line: Callable[[str], None],
                 standby: Standby | None = None) -> None:
        self._own = standby is None
        self.standby = standby if standby is not None else Standby.spawn(env, preload=False)
        self.workdir = workdir
        self.killed_because: str | None = None
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._exit: int | None = None
        self._finished = False
        full = spawn_env(env, run=True)
        with open(os.path.join(workdir, child_module.RUN), "w", encoding="utf-8") as handle:
            json.dump({"env": full}, handle)
        read, write = os.pipe()
        try:
            self.standby.request_run(workdir, write)
        except OSError:  # the standby is gone: stream() reports its exit code
            pass
        finally:
            os.close(write)
        noise = tf_logging.StartupNoise(full)
        self._pump = OutputPump({"output": os.fdopen(read, "rb", buffering=0)},
                                lambda line: on_line(line.text), name="stratkit-training-output", keep=noise.keep)

    @property
    def tail(self) -> list[str]:
        """The last lines of output (the pump's tail policy)."""
        return list(self._pump.tail)

    @property
    def pid(self) -> int | None:
        """The process's PID once the standby reported it (`stream()` waits for it)."""
        return self._pid

    def stream(self) -> int:
        """Forward every line until the process ends; returns its exit code (negative: killed by a signal)."""
        reply = self.standby.next_reply()  # the fork (after the standby's import, when it was still importing)
        with self._lock:
            if reply is not None:
                self._pid = reply["pid"]
                if self.killed_because is not None:  # killed while the standby was forking
                    kill_group(self._pid)
        self._pump.run()  # until the process and everything in its group closed the pipe
        if reply is not None:
            done = self.standby.next_reply()
            if done is not None and done.get("pid") == self._pid:
                self._exit = int(done["exit"])
                self._finished = True
        if self._exit is None:  # the standby died (killed, or it could not fork): its exit code tells why
            code = self.standby.proc.wait()
            self._exit = code if code != 0 else 1
        return self._exit

    def kill(self, reason: str) -> None:
        """SIGKILL the process group (the process and anything it started); idempotent, thread-safe.

        Before the standby reported the PID, the standby itself is killed (a process it forked dies with it).
        """
        with self._lock:
            if self.killed_because is None and self._exit is None:
                self.killed_because = reason
            if self._pid is not None:
                kill_group(self._pid)
            elif self._exit is None:
                self.standby.kill()

    @property
    def finished(self) -> bool:
        """True once the standby reported this process's exit: the standby then waits for its next request."""
        return self._finished

    def result_path(self) -> str:
        return os.path.join(self.workdir, child_module.RESULT)

    def close(self) -> None:
        """Kill whatever is left of the process group; end the standby if this process spawned its own."""
        if self._exit is None:
            self.kill("cleanup")
        elif self._pid is not None:
            kill_group(self._pid)  # anything the process started and left behind in its group
        if self._own:
            self.standby.close()


__all__ = ["Standby", "TrainingProcess", "python_path", "spawn_env"]
