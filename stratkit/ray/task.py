"""One `RayRunner` task: the actor that holds its port, checks its TF_CONFIG and runs its training process.

The runner makes one fresh actor per TF task per attempt, in the run's
placement group (never reused: TensorFlow's collectives are configured once
per process, and the training process is a fresh child anyway). In order:

1. `where()`: the node the actor landed on (Ray's node id; the driver maps it
   to the node's address) and the GPUs Ray assigned it (CUDA_VISIBLE_DEVICES,
   which Ray sets for an actor with GPUs);
2. `hold(host)`: a port held on that address (`stratkit.process.ports`: bound,
   never listening, until the task's TF server listens on it);
3. `start(...)`: with every address known, the task's TF_CONFIG is checked by
   `stratkit.detect` in this actor's environment (`cluster.layout.check_task`)
   before anything imports TensorFlow, then the training process starts
   (`python -m stratkit.ray.child`, `process.children.start_child`: its own
   process group, dying with this actor), its output pumped into a buffer
   without TensorFlow's start-up noise (`stratkit.tf_logging`, as for the
   other front doors);
4. `poll(cursor)`: the lines since `cursor`, and the exit code once it exited;
5. `result()` (the chief's return value, pickled) and `stop()`.

A search's tuner (`RayRunner(tune=True)`) skips 2 and 3: `start_tuner` starts
the same training process without TF_CONFIG, with the search's variables.

Imports no TensorFlow (and Ray only to ask for the node id).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from stratkit import tf_logging
from stratkit.cluster import layout as cluster_layout
from stratkit.cluster.detect import LAUNCHER_VAR
from stratkit.errors import ConfigError
from stratkit.process import ports
from stratkit.process.children import kill_group, start_child
from stratkit.process.payload import PAYLOAD, RESULT
from stratkit.process.pump import Line, OutputPump
from stratkit.ray.child import RESULT_VAR

LAUNCHER = "ray"
#: What to change when a task would not see its place: its environment comes from the Ray node's.
FIX = ("do not set STRATKIT_STRATEGY or STRATKIT_CLUSTER_ENV on the Ray nodes (or in a runtime_env); "
       "the Ray runner decides them")
#: Lines a task keeps for the driver between two polls (older ones are dropped, and counted).
BUFFER_LINES = 10_000
#: How long `poll` waits for a new line or the exit before it answers anyway (seconds).
POLL_WAIT = 0.5


class TaskActor:
    """The actor of one TF task (the runner wraps it with `ray.remote` and its resources)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.workdir = tempfile.mkdtemp(prefix="stratkit-ray-task-")
        self._holder: Any = None
        self._holder_lock = threading.Lock()     # the start thread and stop() both release the held port
        self._proc: subprocess.Popen[bytes] | None = None
        self._pump: OutputPump | None = None
        self._lines: list[str] = []
        self._dropped = 0
        self._exit: int | None = None
        self._changed = threading.Condition()
        self._start_error = ""

    # -- before training ------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def hold(self, host: str) -> int:
        self._holder = ports.hold_port(host)
        return int(self._holder.getsockname()[1])

    def start(self, cluster: Mapping[str, Sequence[str]], role: str, index: int, chief: tuple[str, int],
              payload: bytes, keep_result: bool, visible_devices: str | None,
              extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Check the TF_CONFIG here, then start the training process; {"pid": ...} or {"error": ...}.

        `extra_env`: the driver's MLflow run handed over (`stratkit.training.tracking.handoff`).
        """
        task = cluster_layout.Task(role, index)
        environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        try:
            cluster_layout.check_task(cluster, task, launcher=LAUNCHER, fix=FIX, environ=environ,
                                      chief=cluster_layout.Task(*chief), allow_preset=False)
        except ConfigError as exc:
            return {"error": str(exc)}
        env = {**environ, **(extra_env or {})}
        env["TF_CONFIG"] = cluster_layout.tf_config_json(cluster, role, index)
        env[LAUNCHER_VAR] = LAUNCHER
        return self._launch(env, payload, keep_result, visible_devices)

    def start_tuner(self, tune_env: Mapping[str, str], payload: bytes, visible_devices: str | None,
                    extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Start a search's tuner (`RayRunner(tune=True)`, `stratkit.ray.tune`): no TF_CONFIG, the search's
        variables (`stratkit.tuning.environment.task_env`); {"pid": ...} or {"error": ...}."""
        environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("STRATKIT_TUNE_")}
        return self._launch({**environ, **(extra_env or {}), **tune_env}, payload, True, visible_devices)

    def _launch(self, env: dict[str, str], payload: bytes, keep_result: bool,
                visible_devices: str | None) -> dict[str, Any]:
        env["PYTHONUNBUFFERED"] = "1"
        env.update(tf_logging.quiet_defaults(env))
        if visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices
        if keep_result:
            env[RESULT_VAR] = "1"
        else:
            env.pop(RESULT_VAR, None)
        with open(os.path.join(self.workdir, PAYLOAD), "wb") as handle:
            handle.write(payload)
        started = threading.Event()
        # The thread that starts the child lives exactly as long as the child: the child's die-with-parent
        # signal is tied to it (PR_SET_PDEATHSIG follows the forking thread).
        threading.Thread(target=self._run, args=(env, started), name=f"stratkit-{self.label}", daemon=True).start()
        started.wait()
        if self._proc is None:
            return {"error": f"could not start the training process of {self.label}: {self._start_error}"}
        return {"pid": self._proc.pid}

    def _run(self, env: dict[str, str], started: threading.Event) -> None:
        try:
            self._proc = start_child([sys.executable, "-m", "stratkit.ray.child", self.workdir], env,
                                     cwd=self.workdir)
        except OSError as exc:
            self._start_error = str(exc)
            started.set()
            return
        started.set()
        self._pump = OutputPump({"stdout": self._proc.stdout, "stderr": self._proc.stderr}, self._line,
                                name=f"stratkit-pump-{self.label}", keep=tf_logging.StartupNoise(env).keep).start()
        self._release_port_when_listening()
        code = self._proc.wait()
        self._pump.join()
        with self._changed:
            self._exit = code
            self._changed.notify_all()

    def _release_port_when_listening(self) -> None:
        """Close the held port once the task's TF server listens on it (or the process is gone)."""
        holder = self._holder
        if holder is None:
            return
        host, port = holder.getsockname()[:2]
        while self._proc is not None and self._proc.poll() is None and self._holder is not None:
            if ports.is_listening(host, port, ports.listening_ports()):
                break
            time.sleep(0.1)
        self._release_port()

    def _release_port(self) -> None:
        """Close the held port, once, whichever of the start thread and `stop()` comes first."""
        with self._holder_lock:
            holder, self._holder = self._holder, None
        if holder is not None:
            holder.close()

    def _line(self, line: Line) -> None:
        with self._changed:
            self._lines.append(line.text)
            if len(self._lines) > BUFFER_LINES:
                del self._lines[0]
                self._dropped += 1
            self._changed.notify_all()

    # -- while training -------------------------------------------------------------------------
    def poll(self, cursor: int) -> dict[str, Any]:
        """The lines after `cursor` (a count of lines seen), the next cursor, and the exit code once known."""
        with self._changed:
            if cursor >= self._dropped + len(self._lines) and self._exit is None:
                self._changed.wait(POLL_WAIT)
            start = max(cursor - self._dropped, 0)
            lines = self._lines[start:]
            exception = self._pump.scanner.exception if self._pump is not None and self._exit is not None else ()
            return {"lines": lines, "cursor": self._dropped + len(self._lines), "exit": self._exit,
                    "exception": list(exception), "skipped": max(self._dropped - cursor, 0)}

    def result(self) -> bytes | None:
        path = os.path.join(self.workdir, RESULT)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as handle:
            return handle.read()

    def stop(self) -> int | None:
        """Kill the training process's group (if it still runs), release the port, remove the workdir."""
        if self._proc is not None:
            kill_group(self._proc.pid)  # also what the process left behind in its group
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._release_port()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self._proc.returncode if self._proc is not None else None
