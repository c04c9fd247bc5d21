"""Live task output on the driver: a small TCP log server, and the client each task uses.

Every line a task's training process prints is sent to the driver as it
appears and printed there with the task's prefix (`[worker:1] ...`), so a
user watches all tasks in one console instead of digging through executor
stderr files. The same connection carries the task's exit code to the driver
(so a failure is known within a second, not after Spark's stage bookkeeping)
and, in the other direction, ABORT: when one task fails or the run times out,
the driver tells every other task to kill its training process tree at once.

Protocol (UTF-8 text lines):
    task -> driver   HELLO <token> <rank> <label>   first line; anything else closes the connection
                     L <text>                       one output line
                     X <exit code>                  the training process ended (SETUP_FAILED: never started)
    driver -> task   ABORT <reason>                 kill the training process now

Only connections that present the run's random token are accepted: the server
listens on the driver's address, and without the token anything else on the
network could inject lines or fake an exit code.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

#: Lines kept per task for error messages (the brief of SparkTrainingError: "its last 100 lines").
TAIL_LINES = 100
#: Longer lines are cut: a progress bar without newlines must not become one 100 MB "line".
MAX_LINE = 8000
_HELLO_TIMEOUT = 10.0
#: The exit code a task reports when it failed before its training process started.
SETUP_FAILED = -1000


def _truncate(text: str) -> str:
    return text if len(text) <= MAX_LINE else text[:MAX_LINE] + " ...(truncated)"


@dataclass
class TaskLog:
    """What the driver knows about one task of the current attempt."""

    rank: int
    label: str
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    exit_code: int | None = None
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
    """

    def __init__(self, host: str = "127.0.0.1", on_exit: Callable[[TaskLog], None] | None = None,
                 stream: TextIO | None = None) -> None:
        self.token = secrets.token_hex(16)
        self.host = host
        self._on_exit = on_exit
        self._stream = stream
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()
        self.tasks: dict[int, TaskLog] = {}
        self._connections: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self.rejected = 0
        self._closing = False
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._sock.settimeout(0.2)
        self._acceptor = threading.Thread(target=self._accept_loop, name="stratkit-log-server", daemon=True)
        self._acceptor.start()

    # -- serving --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._handle, args=(conn,), name="stratkit-log-conn", daemon=True)
            thread.start()
            with self._lock:
                self._threads.append(thread)

    def _handle(self, conn: socket.socket) -> None:
        task: TaskLog | None = None
        try:
            conn.settimeout(_HELLO_TIMEOUT)
            reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
            hello = reader.readline().rstrip("\n").split(" ", 3)
            if len(hello) != 4 or hello[0] != "HELLO" or not hmac.compare_digest(hello[1], self.token) \
                    or not hello[2].isdigit():
                with self._lock:
                    self.rejected += 1
                return
            rank, label = int(hello[2]), hello[3]
            conn.settimeout(None)
            with self._lock:
                task = self.tasks.setdefault(rank, TaskLog(rank, label))
                self._connections[rank] = conn
            for raw in reader:
                kind, _, text = raw.rstrip("\n").partition(" ")
                if kind == "L":
                    self._line(task, text)
                elif kind == "X":
                    try:
                        task.exit_code = int(text)
                    except ValueError:
                        task.exit_code = -1
                    if self._on_exit is not None:
                        self._on_exit(task)
        except (OSError, ValueError):
            pass  # a task that vanished; Spark reports the task failure itself
        finally:
            with self._lock:
                if task is not None and self._connections.get(task.rank) is conn:
                    del self._connections[task.rank]
            conn.close()

    def _line(self, task: TaskLog, text: str) -> None:
        text = text.rstrip("\r")
        task.tail.append(text)
        task.lines += 1
        if task.first_line_at is None:
            task.first_line_at = time.time()
        stream = self._stream or sys.stdout
        with self._print_lock:
            stream.write(f"[{task.label}] {text}\n")
            stream.flush()

    # -- control --------------------------------------------------------------------------------
    def abort_all(self, reason: str) -> int:
        """Tell every connected task to kill its training process; returns how many were told."""
        message = f"ABORT {reason}\n".encode()
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
        self._acceptor.join(timeout=2)
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


class LogClient:
    """The task's end. Best effort: if the driver cannot be reached, lines go to this process's stderr.

    Args:
        host, port, token: the driver's log server.
        rank, label: this task.
        on_abort: called (from a reader thread) with the reason when the driver
            sends ABORT, or when the connection to the driver is lost, so the
            task never trains on after the driver gave up.
    """

    def __init__(self, host: str, port: int, token: str, rank: int, label: str,
                 on_abort: Callable[[str], None] | None = None, timeout: float = 10.0) -> None:
        self.label = label
        self._on_abort = on_abort
        self._lock = threading.Lock()
        self._closed = False
        self.connected = False
        self.error: str | None = None
        try:
            self._sock: socket.socket | None = socket.create_connection((host, port), timeout=timeout)
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(f"HELLO {token} {rank} {label}\n".encode())
            self.connected = True
        except OSError as exc:
            self._sock = None
            self.error = f"cannot reach the driver's log server at {host}:{port}: {exc}"
            sys.stderr.write(f"[stratkit] {self.error}; task output stays in this executor's stderr\n")
        if self.connected:
            threading.Thread(target=self._read_loop, name="stratkit-log-abort", daemon=True).start()

    def _read_loop(self) -> None:
        assert self._sock is not None
        reason = "the driver closed the connection"
        try:
            reader = self._sock.makefile("r", encoding="utf-8", errors="replace", newline="\n")
            for raw in reader:
                if raw.startswith("ABORT"):
                    reason = raw.rstrip("\n")[6:] or "aborted by the driver"
                    break
        except (OSError, ValueError):
            pass
        if not self._closed and self._on_abort is not None:
            self._on_abort(reason)

    def _send(self, message: str) -> bool:
        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.sendall(message.encode("utf-8", errors="replace"))
                return True
            except OSError as exc:
                self.error = f"lost the driver's log server: {exc}"
                self._sock = None
                return False

    def line(self, text: str) -> None:
        """Send one output line (no newline inside); falls back to stderr."""
        text = _truncate(text.replace("\n", " "))
        if not self._send(f"L {text}\n"):
            sys.stderr.write(f"[{self.label}] {text}\n")

    def exit_code(self, code: int) -> None:
        """Report the training process's exit code."""
        self._send(f"X {code}\n")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
