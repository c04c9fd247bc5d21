"""Live task output on the driver: a small TCP log server that accepts the tasks' connections.

Every line a task's training process prints is sent to the driver as it
appears and printed there with the task's prefix (`[worker:1] ...`), so a
user watches all tasks in one console instead of digging through executor
stderr files. The same connection carries the task's exit code to the driver
(so a failure is known within a second, not after Spark's stage bookkeeping),
that a task passed a preemption notice on to its training process, and, in
the other direction, ABORT: when one task fails or the run times out,
the driver tells every other task to kill its training process tree at once.

This module is the driver's end: who may connect, how many, for how long.
What travels on a connection (HELLO, L, X, OK, BUSY, ABORT, the line bounds)
and the task's end, `LogClient`, are in `stratkit.spark.logprotocol`; the
names other modules take from here (`LogClient`, `SETUP_FAILED`, `TAIL_LINES`,
`MAX_LINE`) are re-exported.

Only connections that present the run's random token are accepted: the server
listens on the driver's address, and without the token anything else on the
network could inject lines or fake an exit code. Who may connect, and the
limits before a peer authenticated (one selector thread, the HELLO's time and
size bounds, the pending cap, accept() retries, `on_fatal`), are
`stratkit.process.listener.AuthListener`'s, shared with the multi-node
launch's rendezvous. What is this server's own: authenticated connections (one
thread each, dropped when it ends) are capped per run, and a line longer than
`MAX_LINE` characters is cut.
"""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from stratkit.process import listener, pump
from stratkit.process.listener import ACCEPT_GIVE_UP, HELLO_TIMEOUT, MAX_PENDING
from stratkit.process.tracebacks import ExceptionScanner
from stratkit.spark import logprotocol
from stratkit.spark.logprotocol import BUSY, MAX_HELLO, MAX_LINE, SETUP_FAILED, TAIL_LINES, LogClient

__all__ = ["ACCEPT_GIVE_UP", "HELLO_TIMEOUT", "MAX_CONNECTIONS", "MAX_HELLO", "MAX_LINE", "MAX_PENDING",
           "SETUP_FAILED", "TAIL_LINES", "LogClient", "LogServer", "TaskLog"]

#: Authenticated connections at once when the number of tasks is not known.
MAX_CONNECTIONS = 256


@dataclass
class TaskLog:
    """What the driver knows about one task of the current attempt.

    `tail` holds its last lines (`stratkit.process.pump.Tail`, the launcher's
    rule); `scanner` the last exception it printed, however far back, for the
    root-cause report.
    """

    rank: int
    label: str
    tail: pump.Tail = field(default_factory=pump.Tail)
    scanner: ExceptionScanner = field(default_factory=ExceptionScanner)
    exit_code: int | None = None
    #: The signal its Python worker got and passed on to the training process as a preemption notice, if any.
    notice: str | None = None
    lines: int = 0
    first_line_at: float | None = None


class LogServer:
    """The driver's end: accepts authenticated task connections, prints their lines, tracks exit codes.

    Args:
        host: address to listen on (the driver's spark.driver.bindAddress/host).
        on_exit: called as `on_exit(task_log)` from a server thread when a task
            reports its exit code (the runner uses it to abort the others on failure).
        stream: where lines are printed (default: `sys.stdout` at print time,
            so notebook/pytest capture works).
        on_fatal: called once, from the server thread, with a message when the
            server cannot accept connections any more (`self.failure` holds it too).
        max_tasks: the run's number of tasks: a HELLO with a rank outside
            0..max_tasks-1 is rejected, and at most 2 * max_tasks authenticated
            connections are kept (room for a reconnecting task); default: no
            rank check, `MAX_CONNECTIONS`.
        accept_give_up: seconds of failing accept() before the failure is fatal.
    """

    def __init__(self, host: str = "127.0.0.1", on_exit: Callable[[TaskLog], None] | None = None,
                 stream: TextIO | None = None, *, on_fatal: Callable[[str], None] | None = None,
                 max_tasks: int | None = None, accept_give_up: float = ACCEPT_GIVE_UP) -> None:
        self.token = secrets.token_hex(16)
        self._token = self.token.encode("ascii")
        self.host = host
        self._on_exit = on_exit
        self._on_fatal = on_fatal
        self._closing = False       # set once we abort or shut down: connections ending then are ours
        self._stream = stream
        self._max_tasks = max_tasks
        self._max_connections = MAX_CONNECTIONS if max_tasks is None else 2 * max_tasks
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()
        self.tasks: dict[int, TaskLog] = {}
        self._connections: dict[int, socket.socket] = {}
        self._threads: set[threading.Thread] = set()
        #: Why the server stopped accepting (None while it serves); see `on_fatal`.
        self.failure: str | None = None
        self._listener = listener.AuthListener(host, 0, self._token, self._admit, max_number=max_tasks,
                                               on_fatal=self._fail, accept_give_up=accept_give_up)
        self.port: int = self._listener.port

    @property
    def _sock(self) -> socket.socket:
        """The listening socket (tests close it under the server to see the failure reported)."""
        return self._listener.sock

    @property
    def rejected(self) -> int:
        """Connections closed before or at authentication (bad token, timeout, flood, full)."""
        return self._listener.rejected

    @property
    def accept_errors(self) -> int:
        """accept() calls that failed and were retried (e.g. out of file descriptors)."""
        return self._listener.accept_errors

    @property
    def threads(self) -> int:
        """Live connection threads (one per authenticated task connection)."""
        with self._lock:
            return len(self._threads)

    @property
    def pending(self) -> int:
        """Connections accepted but not yet authenticated."""
        return self._listener.pending

    def _admit(self, conn: socket.socket, rank: int, label: str, rest: bytes) -> None:
        with self._lock:
            full = len(self._threads) >= self._max_connections
        if full:
            self._listener.reject(conn, BUSY)
            return
        thread = threading.Thread(target=self._serve_task, args=(conn, rank, label, rest), name="stratkit-log-conn",
                                  daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    # -- one authenticated task (a thread each) -----------------------------------------------------
    def _serve_task(self, conn: socket.socket, rank: int, label: str, rest: bytes) -> None:
        task: TaskLog | None = None
        try:
            conn.sendall(logprotocol.OK)
            with self._lock:
                task = self.tasks.setdefault(rank, TaskLog(rank, label))
                self._connections[rank] = conn
            for kind, text in logprotocol.messages(conn, rest):
                if kind == "L":
                    self._line(task, pump.cut_line(text))
                elif kind == "N":
                    task.notice = text
                elif kind == "X":
                    task.exit_code = logprotocol.exit_code(text)
                    if self._on_exit is not None:
                        self._on_exit(task)
        except OSError:
            pass  # a task that vanished: told below
        finally:
            if task is not None and task.exit_code is None and not self._closing and self._on_exit is not None:
                # its connection ended without an exit record, and not because we stopped it: its process or
                # its host is gone. It is the root cause, not the tasks Spark kills afterwards.
                self._on_exit(task)
            with self._lock:
                if task is not None and self._connections.get(task.rank) is conn:
                    del self._connections[task.rank]
                self._threads.discard(threading.current_thread())
            conn.close()

    def _line(self, task: TaskLog, text: str) -> None:
        text = text.rstrip("\r")
        task.tail.add(text)
        task.scanner.feed(text)
        task.lines += 1
        if task.first_line_at is None:
            task.first_line_at = time.time()
        stream = self._stream or sys.stdout
        with self._print_lock:
            stream.write(f"[{task.label}] {text}\n")
            stream.flush()

    def _fail(self, reason: str) -> None:
        message = (f"the driver's log server on {self.host or '*'}:{self.port} stopped accepting task "
                   f"connections ({reason}). Fix: if it says too many open files, raise the driver's limit "
                   "(ulimit -n); otherwise re-run")
        with self._lock:
            if self.failure is not None:
                return
            self.failure = message
        if self._on_fatal is not None:
            self._on_fatal(message)

    # -- control --------------------------------------------------------------------------------
    def wait_for_exits(self, seconds: float, *, noticed: bool = False,
                       until: Callable[[], bool] = lambda: False) -> None:
        """Wait up to `seconds` (or until `until()`) for every task to report its exit; with `noticed`, only the
        connected tasks that passed a preemption notice on (each saves at the next step, then exits 75)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            with self._lock:
                if noticed:
                    waiting = [t for t in self.tasks.values() if t.notice is not None and t.exit_code is None
                               and t.rank in self._connections]
                else:
                    waiting = [t for t in self.tasks.values() if t.exit_code is None]
                    waiting += [None] * max((self._max_tasks or 0) - len(self.tasks), 0)  # not connected yet
            if not waiting:
                return
            time.sleep(0.05)

    def abort_all(self, reason: str) -> int:
        """Tell every connected task to kill its training process; returns how many were told."""
        message = logprotocol.abort(reason)
        self._closing = True        # connections that end from here on were ended by us
        with self._lock:
            connections = list(self._connections.values())
        told = 0
        for conn in connections:
            try:
                conn.sendall(message)
                told += 1
            except OSError:
                pass
        return told

    def shutdown(self, drain_seconds: float = 2.0) -> None:
        """Stop accepting, give open connections `drain_seconds` to deliver their last lines, close all."""
        self._closing = True
        self._listener.close()
        deadline = time.monotonic() + drain_seconds
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            connections = list(self._connections.values())
        for conn in connections:
            listener.shut(conn)

