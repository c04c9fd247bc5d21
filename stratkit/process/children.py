"""Start a child process that cannot outlive us, and stop process groups.

Three guarantees, each for a different way the parent can end:

- the child runs in its own session, hence its own process group: it and
  whatever it starts are stopped as one group, and a Ctrl-C at our terminal
  does not reach it behind our back (the parent decides);
- die-with-parent: the kernel sends the child SIGKILL when the parent thread
  that started it ends (PR_SET_PDEATHSIG, Linux), even when the parent is
  SIGKILLed; a child whose parent was already gone before that took effect
  kills itself;
- the child's own children, which PR_SET_PDEATHSIG does not reach, are left
  to the reaper (`stratkit.process.reaper`).

`start_child` executes a program; `fork_child` forks the calling process
instead, for a single-threaded parent that has already imported what its
children need (the Spark executor's standby, `stratkit.spark.process`): the
child starts with those imports done, and with the same three guarantees.

Because a child runs in its own session, a signal its parent's process group
gets (a Spark executor's daemon stopping its Python workers with SIGHUP, a
SIGTERM to the parent) never reaches it; die-with-parent then ends it with
SIGKILL, mid-step. `passing_on_notices` hands such a notice on as SIGTERM, so a
training process with a backup directory saves at its next step boundary and
exits 75 (`stratkit.status.EXIT_PREEMPTED`) while its parent waits for it.

Every child gets pyarrow's jemalloc as its Arrow memory pool unless its environment names one
(`ARROW_POOL`): the table reader's decoded row groups and fetched column chunks come and go a block at a
time, from several threads, and pyarrow's default mimalloc keeps what they freed, per thread. Measured
(`benchmarks/bench_lake.py`, 2 workers under `stratkit launch`, a table 10x a 24 MiB `read_ahead_bytes`): each
worker's peak grew 40-49 MiB over a tiny table's with mimalloc, 24-33 MiB with jemalloc, which also decoded
faster. The pool is read once, when pyarrow loads, so it is set here, before the child starts.

Imports no TensorFlow.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved at import so a forked child only calls it (no imports between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - Linux always has it
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Make the kernel SIGKILL this process when its parent ends; if `parent_pid` is already gone, die now.

    Call it first thing in the child (or let `start_child` run it between fork
    and exec). The parent is the *thread* that forked us: fork from a thread
    that lives as long as the child should. The getppid check closes the
    window in which the parent died before prctl took effect (we would have
    been re-parented already, and no signal would come).
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _before_exec(parent_pid: int, enter: Callable[[], None] | None) -> Callable[[], None]:
    def setup() -> None:
        # `enter` (e.g. joining a private network namespace) may change the child's credentials,
        # which clears PDEATHSIG: so it runs first.
        if enter is not None:
            enter()
        die_with_parent(parent_pid)

    return setup


def start_server(code: str, interpreter: Sequence[str], env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start `interpreter -c code` as a child (`start_child`) whose stdin is one end of a SEQPACKET socketpair.

    For the standbys both launchers fork their tasks from (`launch/standby.py`,
    `spark/process.py`): the child reads one request per message on fd 0 and can
    receive file descriptors there. `-c` rather than `-m`: runpy warns when the
    package already imported the module. The child's own output is only its
    imports' start-up noise (each run's output goes to that run's pipe), so it is
    discarded. Returns the process and our end of the socket.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc = start_child([*interpreter, "-c", code], env, stdin=theirs, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


#: The Arrow memory pool of the processes we start (module docstring), on Linux, where pyarrow's wheels have it.
ARROW_POOL = "jemalloc" if sys.platform.startswith("linux") else None


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as a child gets it: with `ARROW_POOL` as `ARROW_DEFAULT_MEMORY_POOL` unless `env` names a pool."""
    out = dict(env)
    if ARROW_POOL and not out.get("ARROW_DEFAULT_MEMORY_POOL"):
        out["ARROW_DEFAULT_MEMORY_POOL"] = ARROW_POOL
    return out


def start_child(argv: Sequence[str], env: Mapping[str, str], *, stdout: int | IO[Any] | None = subprocess.PIPE,
                stderr: int | IO[Any] | None = subprocess.PIPE, stdin: int | IO[Any] | None = subprocess.DEVNULL,
                cwd: str | None = None, enter: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (its own process group), dying with this process.

    Args:
        argv: the program and its arguments.
        env: the child's complete environment (`child_environment` adds pyarrow's pool).
        stdout, stderr: as for `subprocess.Popen` (default: pipes, for `stratkit.process.pump`;
            `stderr=subprocess.STDOUT` merges them into one stream).
        stdin: as for `subprocess.Popen` (default: nothing to read; a pipe hands the child work later).
        cwd: the child's working directory (default: ours).
        enter: a step to run in the child between fork and exec, before die-with-parent; it may
            only call C functions loaded beforehand (the forked child of a threaded process must
            not take locks), and should `os._exit` on failure.

    Raises:
        OSError: when the program cannot be started.
    """
    return subprocess.Popen(
        list(argv), stdin=stdin, stdout=stdout, stderr=stderr, env=child_environment(env), cwd=cwd,
        start_new_session=True,
        # preloaded C calls only, no locks: safe in a threaded parent despite the general warning
        preexec_fn=_before_exec(os.getpid(), enter),  # noqa: PLW1509
    )


def fork_child(run: Callable[[], int], *, output_fd: int, close_fds: Sequence[int] = ()) -> int:
    """Fork; the child calls `run()` in a new process group, dying with us, and exits with its return value.

    The child's stdout and stderr are `output_fd` (the write end of a pipe the
    caller's reader follows); `close_fds` are closed in the child (the
    parent's own channels). The child ends with `os._exit`: it never returns
    into the caller's code, and an exception escaping `run` is printed and
    exits 1. Returns the child's PID, which is also its process group's.

    Fork only from a process with no thread that may hold a lock the child
    needs: the child has only the forking thread. Python's own locks are fine
    when the parent runs nothing else meanwhile.
    """
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # buffered output must not be written twice
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which leaves through os._exit
        code = 1
        try:
            os.setpgid(0, 0)
            die_with_parent(parent)
            os.dup2(output_fd, 1)
            os.dup2(output_fd, 2)
            for fd in (output_fd, *close_fds):
                os.close(fd)
            _write_to_fds()
            code = run()
        except BaseException:  # noqa: BLE001 - the child must leave here, whatever happened
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code if isinstance(code, int) else 1)
    try:  # also from this side: the group exists before the caller can signal it, whoever runs first
        os.setpgid(pid, pid)
    except OSError:  # the child got there first, or already ended
        pass
    return pid


def _write_to_fds() -> None:
    """Point sys.stdout and sys.stderr at fds 1 and 2 where they write elsewhere (e.g. a test's capture)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            if getattr(sys, name).fileno() == fd:
                continue
        except (AttributeError, OSError, ValueError):
            pass
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                            errors="backslashreplace", line_buffering=True, write_through=True))


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to process group `pgid`; a group that is gone (or no longer ours) is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Sequence[subprocess.Popen[Any]], grace: float,
                hurry: Callable[[], bool] | None = None) -> None:
    """Stop each process's group: SIGTERM, up to `grace` seconds to exit, then SIGKILL; reap them all.

    SIGTERM first, so a program can save or clean up. `hurry()` returning True
    (e.g. a second Ctrl-C arrived) ends the wait early. Each process must lead
    its group (`start_child` does that).
    """
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (any(p.poll() is None for p in running) and time.monotonic() < deadline
           and not (hurry is not None and hurry())):
        time.sleep(0.05)
    for proc in running:
        if proc.poll() is None:
            kill_group(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def passing_on_notices(group: Callable[[], int | None], signals: Sequence[int],
                       on_notice: Callable[[int], None] | None = None) -> Iterator[list[int]]:
    """While the block runs, each of `signals` reaching this process is sent on to a child's group as SIGTERM.

    For a parent that waits for its child (a Spark task for its training
    process): the parent stays, the child gets the notice (SIGTERM is always a
    preemption notice), saves and exits on its own. Yields the list of the
    signals that arrived (the caller can say so). Only the main thread can
    catch signals: elsewhere nothing is installed and the list stays empty.

    Args:
        group: the child's process group id once it is known (None before: the notice is sent when the
            child is known, at the next signal; a child that had not started has nothing to save).
        signals: the signal numbers to catch (e.g. SIGTERM, SIGHUP, the preemption signal).
        on_notice: called with the signal number from the handler (it must not block or take a lock the
            interrupted code may hold: start a thread for anything more).
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        pgid = group()
        if pgid is not None:
            kill_group(pgid, signal.SIGTERM)
        if on_notice is not None:
            on_notice(signum)

    previous = {}
    try:
        for sig in dict.fromkeys(signals):
            previous[sig] = signal.signal(sig, on_signal)
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
