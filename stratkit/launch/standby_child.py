"""The standby of an elastic node: an interpreter that imported TensorFlow and Keras and forks the node's tasks.

`stratkit.launch.standby.TaskStandby` starts this module's `main()` as
`<the command's python> [-u] -c ...`, with the environment every task of the
launch shares, and its control socket (a Unix SEQPACKET socketpair) as fd 0.
It imports TensorFlow, Keras and stratkit -- no TensorFlow context, server or
device -- says so, then serves fork requests: each carries a task's complete
environment, its command (`python script.py ...` or `python -m module ...`)
and two descriptors, the write ends of the task's stdout and stderr pipes.
Replies: the forked task's PID, and later its exit status.

The forked task (`_task`) is a fresh process for TensorFlow: it takes exactly
the environment a started task would get (TF_CONFIG, CUDA_VISIBLE_DEVICES and
the thread counts are read when its context starts, after the fork), stdin
from /dev/null, its own process group, dies with the standby (which dies with
the launcher), and runs the script as `python` would: `sys.argv`, `sys.path[0]`
and `__main__` as for `python script.py` (or `-m module`). It leaves through
the interpreter's own exit, unwinding `main()`: exit codes, uncaught
exceptions (the traceback starts at the script's frame), atexit handlers and
non-daemon threads behave as in a process started for it.

Why: a task started for each round imports TensorFlow first, seconds of CPU
(measured 11-15 s on the loaded 2-core machine) on the path from a membership
change to the first step at the new size. Forked, a round's task starts with
those imports done. Why fork is safe here, as for the Spark runner's standby
(`stratkit.spark.child`): this process runs one thread of its own while it
forks (the select loop); what the imports started are idle thread servers
that do not hold locks the child needs, and TensorFlow's threads start with
its context, which only a forked task creates.

Imports no TensorFlow itself: `_preload` does, in the standby only.
"""

from __future__ import annotations

import builtins
import gc
import importlib.machinery
import io
import json
import os
import runpy
import select
import socket
import sys
import time
import traceback
import types
from typing import Any

from stratkit.process.children import die_with_parent

#: Imported before the first fork: what every task imports first (stratkit's Trainer and its strategy).
PRELOAD = ("tensorflow", "keras", "stratkit", "stratkit.strategy.factory", "stratkit.training.trainer")
#: The largest control message: a request carries a task's environment.
MESSAGE_BYTES = 1 << 20
#: How often the standby looks for ended tasks while it waits for a request.
_REAP_EVERY = 0.05


def _send(channel: socket.socket, message: dict[str, Any]) -> bool:
    try:
        channel.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _preload(names: tuple[str, ...]) -> None:
    for name in names:
        __import__(name)


def main(preload: tuple[str, ...] = PRELOAD) -> int:
    """The standby: import `preload`, say so, then fork one task per request until the launcher closes the
    channel."""
    channel = socket.socket(fileno=0)
    started = time.monotonic()
    try:
        _preload(preload)
    except BaseException:  # noqa: BLE001 - the launcher falls back to starting each task itself
        _send(channel, {"ready": False, "error": traceback.format_exc(limit=8)[-4000:]})
        return 1
    # No garbage collection here, and what was imported frozen before each fork: a task's collections then never
    # walk (and copy, page by page) the imports' objects (as the Spark runner's standby, `stratkit.spark.child`).
    gc.disable()
    if not _send(channel, {"ready": True, "seconds": round(time.monotonic() - started, 3)}):
        return 0
    tasks: set[int] = set()
    while True:
        readable, _, _ = select.select([channel], [], [], _REAP_EVERY)
        if readable:
            try:
                message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 2)
            except OSError:
                message, fds = b"", []
            if not message:  # the launcher is done (or gone): the tasks die with us
                os._exit(0)
            request = json.loads(message)
            gc.freeze()
            for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            standby = os.getpid()
            pid = os.fork()
            if pid == 0:
                channel.detach()  # fd 0: `_task` puts /dev/null in its place (closing it now would free fd 0)
                return _task(request, fds, standby)  # the task leaves through the interpreter's exit, as `python` does
            try:
                os.setpgid(pid, pid)  # (also from this side: the group exists before anyone signals it)
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            tasks.add(pid)
            _send(channel, {"id": request["id"], "pid": pid})
        while tasks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            tasks.discard(pid)
            _send(channel, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def _task(request: dict[str, Any], fds: list[int], standby: int) -> int:
    """In the forked task: its descriptors, group, environment, argv and path; then the script, as `python` runs it."""
    os.setpgid(0, 0)
    die_with_parent(standby)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # (replaces the control socket)
    if devnull != 0:
        os.close(devnull)
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (out, err):
        if fd > 2:
            os.close(fd)
    gc.enable()  # for what the task allocates; the standby's objects stay frozen
    env = request["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    if "numpy" in sys.modules:  # its global generator was seeded once in the standby: every fork would repeat it
        sys.modules["numpy"].random.seed()
    sys.excepthook = _from_the_script(sys.excepthook)
    kind, target, args = request["run"]
    if kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        if os.path.isfile(target):
            _run_script(os.path.abspath(target))
        else:  # a directory or zip with __main__.py
            runpy.run_path(target, run_name="__main__")
    return 0


def _run_script(path: str) -> None:
    """Run the file at `path` (absolute) as `__main__`, as `python path` does: `sys.argv[0]` stays as given (runpy
    would set it to the path), and the module stays `__main__` for the rest of the process (atexit, pickling)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    with io.open_code(path) as handle:
        code = compile(handle.read(), path, "exec")
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - running the user's script is this process's job


def _from_the_script(hook: Any) -> Any:
    """An excepthook that prints an uncaught exception's traceback from the script's first frame on."""
    ours = {os.path.realpath(__file__), os.path.realpath(runpy.__file__), "<string>", "<frozen runpy>"}

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        start = tb
        while start is not None and (start.tb_frame.f_code.co_filename in ours
                                     or os.path.realpath(start.tb_frame.f_code.co_filename) in ours):
            start = start.tb_next
        start = start if start is not None else tb
        hook(kind, value.with_traceback(start), start)  # (the default hook prints the value's own traceback)

    return excepthook
