"""Live task output on the driver: a small TCP log server that accepts the tasks' connections.

Every line a task's training process prints is sent to the driver as it
appears and printed there with the task's prefix (`[worker:1] ...`), so a
user watches all tasks in one console instead of digging through executor
stderr files. The same connection carries the task's exit code to the driver
(so a failure is known within a second, not after Spark's stage bookkeeping)
and, in the other direction, ABORT: when one task fails or the run times out,
the driver tells every other task to kill its training process tree at once.

This module is the driver's end: who may connect, how many, for how long.
What travels on a connection (HELLO, L, X, OK, BUSY, ABORT, the line bounds)
and the task's end, `LogClient`, are in `stratkit.spark.logprotocol`; the
names other modules take from here (`LogClient`, `SETUP_FAILED`, `TAIL_LINES`,
`MAX_LINE`) are re-exported.

Only connections that present the run's random token are accepted: the server
listens on the driver's address, and without the token anything else on the
network could inject lines or fake an exit code. Nothing a client sends is
trusted, decoded as more than bytes, or kept beyond a small bound before it has
authenticated, and one client cannot stop the server or starve the run:

  * unauthenticated connections are served by one selector thread, never a
    thread each; the HELLO must arrive whole within `HELLO_TIMEOUT` seconds
    and `MAX_HELLO` bytes, at most `MAX_PENDING` wait at once (the oldest is
    dropped with BUSY for a new one, so a flood cannot lock tasks out);
  * authenticated connections (one thread each, dropped when it ends) are
    capped per run, and a line longer than `MAX_LINE` characters is cut;
  * accept() errors such as "too many open files" are retried with backoff;
    an error the server cannot recover from calls `on_fatal`, so the run
    fails with a clear message instead of waiting for logs that never come.
"""

from __future__ import annotations

import errno
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from stratkit.process import pump
from stratkit.process.tracebacks import ExceptionScanner
from stratkit.spark import logprotocol
from stratkit.spark.logprotocol import BUSY, MAX_HELLO, MAX_LINE, SETUP_FAILED, TAIL_LINES, LogClient

__all__ = ["ACCEPT_GIVE_UP", "HELLO_TIMEOUT", "MAX_CONNECTIONS", "MAX_HELLO", "MAX_LINE", "MAX_PENDING",
           "SETUP_FAILED", "TAIL_LINES", "LogClient", "LogServer", "TaskLog"]

#: Seconds a connection has to deliver its whole HELLO (not per byte: a trickle cannot extend it).
HELLO_TIMEOUT = 10.0
#: Unauthenticated connections held at once.
MAX_PENDING = 64
#: Authenticated connections at once when the number of tasks is not known.
MAX_CONNECTIONS = 256
#: Seconds accept() may keep failing (e.g. EMFILE) before the server gives up and reports it fatal.
ACCEPT_GIVE_UP = 60.0

# accept() errors that concern one connection, or resources that come back: retry (see accept(2)).
_RETRY_NOW = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT, errno.EHOSTDOWN,
              errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.ETIMEDOUT,
              getattr(errno, "ENONET", errno.ENETDOWN)}
_RETRY_LATER = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


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
    lines: int = 0
    first_line_at: float | None = None


@dataclass
class _Pending:
    """An accepted connection that has not authenticated yet."""

    conn: socket.socket
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)


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
        self._stream = stream
        self._max_tasks = max_tasks
        self._max_connections = MAX_CONNECTIONS if max_tasks is None else 2 * max_tasks
        self._accept_give_up = accept_give_up
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()
        self.tasks: dict[int, TaskLog] = {}
        self._connections: dict[int, socket.socket] = {}
        self._threads: set[threading.Thread] = set()
        self.rejected = 0
        #: accept() calls that failed and were retried (e.g. out of file descriptors).
        self.accept_errors = 0
        #: Why the server stopped accepting (None while it serves); see `on_fatal`.
        self.failure: str | None = None
        self._closing = False
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self._accept_failing_since: float | None = None
        self._accept_backoff = 0.0
        self._accept_resume_at: float | None = None
        self._sock = socket.create_server((host, 0), backlog=128)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        # shutdown() wakes the selector at once: closing a socket does not end an epoll wait, and the run's
        # return would otherwise wait out the poll interval (measured: 0.1-0.2 s of every run()).
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._acceptor = threading.Thread(target=self._serve, name="stratkit-log-server", daemon=True)
        self._acceptor.start()

    @property
    def threads(self) -> int:
        """Live connection threads (one per authenticated task connection)."""
        with self._lock:
            return len(self._threads)

    @property
    def pending(self) -> int:
        """Connections accepted but not yet authenticated."""
        return len(self._pending)

    # -- accepting and authenticating (one thread, a selector) ------------------------------------
    def _serve(self) -> None:
        try:
            while not self._closing:
                if self._sock.fileno() == -1:
                    raise OSError(errno.EBADF, "its listening socket was closed")
                now = time.monotonic()
                if self._accept_resume_at is not None and now >= self._accept_resume_at:
                    self._accept_resume_at = None
                    self._selector.register(self._sock, selectors.EVENT_READ)
                timeout = 0.2 if self._accept_resume_at is None else min(0.2, self._accept_resume_at - now)
                for key, _ in self._selector.select(max(0.0, timeout)):
                    if key.fileobj is self._wake:
                        continue  # shutdown(): the loop's condition ends it
                    if key.fileobj is self._sock:
                        self._accept_some()
                    elif key.fileobj in self._pending:
                        self._read_hello(self._pending[key.fileobj])
                self._expire_pending(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - whatever stops this loop stops the server: report it
            if not self._closing:
                self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._wake.close()

    def _accept_some(self) -> None:
        for _ in range(MAX_PENDING):  # then serve the HELLOs that arrived: accepting must not starve them
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _RETRY_NOW:
                    continue
                if exc.errno not in _RETRY_LATER:
                    raise
                self._accept_failed(exc)
                return
            self._accept_failing_since = None
            self._accept_backoff = 0.0
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending.values())), BUSY)
            conn.setblocking(False)
            pending = _Pending(conn, time.monotonic() + HELLO_TIMEOUT)
            self._pending[conn] = pending
            self._selector.register(conn, selectors.EVENT_READ)
            self._read_hello(pending)  # a task sends its HELLO with the connection: often it is here already

    def _accept_failed(self, exc: OSError) -> None:
        """Out of file descriptors or memory: free what we can, pause accepting, give up after a while."""
        now = time.monotonic()
        self.accept_errors += 1
        if self._accept_failing_since is None:
            self._accept_failing_since = now
        elif now - self._accept_failing_since > self._accept_give_up:
            raise OSError(exc.errno, f"accept() kept failing for {self._accept_give_up:.0f}s: {exc.strerror}")
        if self._pending and exc.errno in (errno.EMFILE, errno.ENFILE):
            self._drop(next(iter(self._pending.values())), BUSY)  # an idle client's descriptor, for a task
        self._accept_backoff = min(1.0, max(0.005, 2 * self._accept_backoff))
        self._selector.unregister(self._sock)  # a listening socket stays readable: pause, do not spin
        self._accept_resume_at = now + self._accept_backoff

    def _read_hello(self, pending: _Pending) -> None:
        try:
            data = pending.conn.recv(MAX_HELLO + 1 - len(pending.buffer))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pending)
            return
        pending.buffer += data
        end = pending.buffer.find(b"\n")
        if end < 0:
            if len(pending.buffer) > MAX_HELLO:
                self._drop(pending)
            return
        line, rest = bytes(pending.buffer[:end]), bytes(pending.buffer[end + 1:])
        del self._pending[pending.conn]
        self._selector.unregister(pending.conn)
        self._admit(pending.conn, line, rest)

    def _expire_pending(self, now: float) -> None:
        for pending in list(self._pending.values()):
            if pending.deadline > now:
                break  # insertion order: the rest are younger
            self._drop(pending)

    def _drop(self, pending: _Pending, message: bytes = b"") -> None:
        """Close a connection that did not (or could not) authenticate."""
        if self._pending.pop(pending.conn, None) is not None:
            try:
                self._selector.unregister(pending.conn)
            except (KeyError, ValueError):
                pass
        self._reject(pending.conn, message)

    def _reject(self, conn: socket.socket, message: bytes = b"") -> None:
        with self._lock:
            self.rejected += 1
        if message:
            try:
                conn.send(message)
            except OSError:
                pass
        conn.close()

    def _admit(self, conn: socket.socket, line: bytes, rest: bytes) -> None:
        hello = logprotocol.parse_hello(line, self._token, self._max_tasks)
        if hello is None:
            self._reject(conn)
            return
        with self._lock:
            full = len(self._threads) >= self._max_connections
        if full:
            self._reject(conn, BUSY)
            return
        thread = threading.Thread(target=self._serve_task, args=(conn, *hello, rest), name="stratkit-log-conn",
                                  daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    # -- one authenticated task (a thread each) -----------------------------------------------------
    def _serve_task(self, conn: socket.socket, rank: int, label: str, rest: bytes) -> None:
        task: TaskLog | None = None
        try:
            conn.setblocking(True)
            conn.sendall(logprotocol.OK)
            with self._lock:
                task = self.tasks.setdefault(rank, TaskLog(rank, label))
                self._connections[rank] = conn
            for kind, text in logprotocol.messages(conn, rest):
                if kind == "L":
                    self._line(task, pump.cut_line(text))
                elif kind == "X":
                    task.exit_code = logprotocol.exit_code(text)
                    if self._on_exit is not None:
                        self._on_exit(task)
        except OSError:
            pass  # a task that vanished; Spark reports the task failure itself
        finally:
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
        try:  # refuse new connections at once: a task then logs to its stderr instead of waiting in a backlog
            self._sock.close()
        except OSError:
            pass
        if self._on_fatal is not None:
            self._on_fatal(message)

    # -- control --------------------------------------------------------------------------------
    def abort_all(self, reason: str) -> int:
        """Tell every connected task to kill its training process; returns how many were told."""
        message = logprotocol.abort(reason)
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
        self._sock.close()
        try:
            self._waker.send(b"x")
        except OSError:
            pass
        self._acceptor.join(timeout=2)
        self._waker.close()
        deadline = time.monotonic() + drain_seconds
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            connections = list(self._connections.values())
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

