"""An elastic node's standby: TensorFlow imported once, each round's tasks forked from it (`TaskStandby`).

Under `stratkit launch --nnodes MIN:MAX` every membership change starts the
node's tasks again, and a task started as a new interpreter imports
TensorFlow and Keras before anything else: seconds of CPU (11-15 s measured on
the loaded 2-core machine, about 3 s quiet) on the path from the change to the
first step at the new size. So an elastic node starts one standby as soon as
it starts (`stratkit.launch.standby_child`: the command's own interpreter,
with the environment the tasks share, imports TensorFlow, Keras and stratkit,
and creates no TensorFlow context), joins the rendezvous once it is ready,
and forks every round's tasks from it. A forked task gets the environment,
argv, working directory and `__main__` a started one gets, and its own pipes
and process group; the launcher follows it through `ForkedTask`, the part of
`subprocess.Popen` it uses.

Only for a command the standby can run as `python` would: `python [-u]
script.py ...` or `python [-u] -m module ...` (any other command, or
STRATKIT_STANDBY=0, starts each task itself, as before). What differs from a
started task: TensorFlow and Keras are imported before the script runs, so a
variable the script sets in `os.environ` to steer their import (e.g.
TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS) comes too late; set it in the
launcher's environment instead (variables read when TensorFlow's context
starts, TF_CONFIG and CUDA_VISIBLE_DEVICES among them, work as before).
A standby that cannot import, or dies, is replaced by starting each task
itself, with one line saying why.

Imports no TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from stratkit.launch import standby_child
from stratkit.process.children import kill_group, start_server

#: "0" (or "off", "false", "no"): no standby; every task is started as a new process.
STANDBY_VAR = "STRATKIT_STANDBY"
_ENTRY = "import sys; from stratkit.launch.standby_child import main; sys.exit(main({}))"
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")
#: Longest wait for the standby's reply to a fork request (it forks at once once ready).
_FORK_REPLY = 30.0


def python_run(command: Sequence[str]) -> tuple[list[str], tuple[str, str, list[str]]] | None:
    """(the interpreter and its flags, (kind, target, args)) for `python [-u] script.py ...` or `python [-u] -m
    module ...`, kind "path" or "module"; None for any other command (a standby cannot run it as `python` does)."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return None
    interpreter, rest = [command[0]], list(command[1:])
    while rest and rest[0] == "-u":
        interpreter.append(rest.pop(0))
    if len(rest) >= 2 and rest[0] == "-m" and not rest[1].startswith("-"):
        return interpreter, ("module", rest[1], rest[2:])
    if rest and not rest[0].startswith("-"):
        return interpreter, ("path", rest[0], rest[1:])
    return None


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether STRATKIT_STANDBY leaves the standby on (the default)."""
    return environ.get(STANDBY_VAR, "1").strip().lower() not in ("0", "off", "false", "no")


class ForkedTask:
    """A task the standby forked: `pid` (its process group too), `stdout`, `stderr`, `poll()`, `wait()`,
    `returncode` (negative: the signal), as `subprocess.Popen` has them."""

    forked = True

    def __init__(self, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.pid = 0
        self.returncode: int | None = None
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"task {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._started.set()
        self._ended.set()


class TaskStandby:
    """The standby of this node (see the module docstring). `start` returns None when there can be none."""

    def __init__(self, interpreter: list[str], run: tuple[str, str, list[str]] | None, env: Mapping[str, str],
                 preload: tuple[str, ...] | None = None) -> None:
        """Start it (`interpreter`, environment `env`); `run`: the command every fork runs (None: each fork names
        its own); `preload`: the modules it imports (default: `standby_child.PRELOAD`)."""
        self.run = run
        self.error: str | None = None  # why it cannot fork (it could not import, or it died)
        self.import_seconds: float | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._pending: dict[int, ForkedTask] = {}
        self._tasks: dict[int, ForkedTask] = {}
        self._next = 0
        self.proc, self._channel = start_server(_ENTRY.format("" if preload is None else repr(tuple(preload))),
                                                interpreter, env)
        threading.Thread(target=self._read, name="stratkit-standby", daemon=True).start()

    @classmethod
    def start(cls, command: Sequence[str], env: Mapping[str, str]) -> TaskStandby | None:
        """A standby for `command`'s tasks with environment `env` (what every task shares), or None: not a
        command it can run, STRATKIT_STANDBY=0, or its interpreter did not start."""
        found = python_run(command)
        if found is None or not wanted(env):
            return None
        try:
            return cls(found[0], found[1], env)
        except OSError:
            return None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> bool:
        """Wait until it imported (True) or failed (False; `error` says why), at most `timeout` s."""
        self._ready.wait(timeout)
        return self.ready

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def fork(self, env: Mapping[str, str], *, run: tuple[str, str, list[str]] | None = None,
             cwd: str | None = None, output: tuple[int, int] | None = None) -> ForkedTask | None:
        """Fork a task; None when the standby is not ready or is gone.

        Args:
            env: the task's complete environment.
            run: its command as `python_run` gives it, (kind, target, args) (default: the standby's own).
            cwd: its working directory (default: ours).
            output: descriptors (stdout, stderr) it writes to instead of new pipes (files, say); the
                task's `stdout` and `stderr` are then None.
        """
        if not self.ready:
            return None
        kind, target, args = run or self.run
        if output is None:
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            task = ForkedTask(os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
        else:
            out_write, err_write = os.dup(output[0]), os.dup(output[1])
            task = ForkedTask(None, None)
        with self._lock:
            self._next += 1
            number = self._next
            self._pending[number] = task
        request = {"id": number, "env": dict(env), "run": [kind, target, list(args)], "cwd": cwd or os.getcwd()}
        try:
            socket.send_fds(self._channel, [json.dumps(request).encode()], [out_write, err_write])
        except OSError:
            task._end(-signal.SIGKILL)
        finally:
            os.close(out_write)
            os.close(err_write)
        task._started.wait(_FORK_REPLY)
        if not task.pid:  # no reply: the standby is gone (or stuck); the caller starts the task itself
            with self._lock:
                self._pending.pop(number, None)
            for stream in (task.stdout, task.stderr):
                if stream is not None:
                    stream.close()
            if self.error is None:
                self.error = "it did not answer a fork request"
            return None
        return task

    def _read(self) -> None:
        """Follow the standby's messages: ready, a fork's PID, a task's exit; at its end, end what is left."""
        while True:
            try:
                data = self._channel.recv(standby_child.MESSAGE_BYTES)
                message = json.loads(data) if data else None
            except (OSError, ValueError):
                message = None
            if not isinstance(message, dict):
                break
            if "ready" in message:
                if not message["ready"]:
                    last = (str(message.get("error") or "").strip().splitlines() or ["no reason given"])[-1]
                    self.error = f"it could not import ({last})"
                self.import_seconds = message.get("seconds")
                self._ready.set()
            elif "id" in message:
                with self._lock:
                    task = self._pending.pop(int(message["id"]), None)
                    if task is not None:
                        task.pid = int(message["pid"])
                        self._tasks[task.pid] = task
                if task is not None:
                    task._started.set()
            elif "exit" in message:
                with self._lock:
                    task = self._tasks.pop(int(message["pid"]), None)
                if task is not None:
                    task._end(int(message["exit"]))
        # The standby is gone: its tasks died with it (die-with-parent), and it forks no more.
        if self.error is None:
            code = self.proc.wait()
            self.error = f"it ended ({'signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
        self._ready.set()
        with self._lock:
            left = list(self._tasks.values()) + list(self._pending.values())
            self._tasks.clear()
            self._pending.clear()
        for task in left:
            task._end(-signal.SIGKILL)

    def close(self) -> None:
        """End the standby (a task it forked that still runs dies with it) and reap it."""
        try:
            self._channel.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        kill_group(self.proc.pid)
        self.proc.wait()
        self._channel.close()


def shared_env(env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment every task of a launch shares (the plan's, with its extras), without a TF_CONFIG."""
    out = {k: v for k, v in env.items() if k != "TF_CONFIG"}
    out.update(extra)
    return out


__all__ = ["STANDBY_VAR", "ForkedTask", "TaskStandby", "python_run", "shared_env", "wanted"]
