"""What a task and the driver's log server say to each other, and the task's end of it (`LogClient`).

Every line a task's training process prints is sent to the driver as it
appears; the same connection carries the task's exit code to the driver and,
in the other direction, ABORT. The driver's end, with the limits on who may
connect and how many, is `stratkit.spark.logserver`; this module is the one
place for the wire format both ends speak, so neither can change it alone.

Protocol (UTF-8 text lines):
    task -> driver   HELLO <token> <rank> <label>   first line; anything else closes the connection
                     L <text>                       one output line
                     N <signal name>                the task passed a preemption notice on to its training
                                                    process (its Python worker was told to go)
                     X <exit code>                  the training process ended (SETUP_FAILED: never started)
    driver -> task   OK                             the HELLO was accepted
                     BUSY                           dropped before authentication (server full): retry
                     ABORT <reason>                 kill the training process now

The framing is bounded on both ends: a HELLO is at most `MAX_HELLO` bytes, a
line longer than `MAX_LINE` characters is cut (by the client before sending,
by the server however a peer sends it), and the server decodes nothing but the
rank and label of a HELLO before its token matched.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from stratkit import status
from stratkit.process import listener, pump

#: Lines kept per task for error messages: the one tail rule of `stratkit.process.pump` (also the launcher's).
TAIL_LINES = pump.TAIL_LINES
#: Longer lines are cut (the tail's rule too): a progress bar without newlines must not become one 100 MB "line".
MAX_LINE = pump.TAIL_LINE_CHARS
#: The same bound in bytes, as read from a socket (a UTF-8 character is at most 4 bytes).
MAX_LINE_BYTES = 4 * MAX_LINE
#: Longest HELLO line (`stratkit.process.listener`'s bound).
MAX_HELLO = listener.MAX_HELLO
#: The exit code a task reports when it failed before its training process started.
SETUP_FAILED = -1000

OK = listener.OK
BUSY = listener.BUSY

log = status.logger(__name__)


# -- the driver's side of the format ------------------------------------------------------------
#: (rank, label) from a HELLO line, or None: the token check of `stratkit.process.listener` (the one rule).
parse_hello = listener.check_hello


def messages(conn: socket.socket, start: bytes) -> Iterator[tuple[str, str]]:
    """The (kind, text) messages an authenticated task sends on `conn` after its HELLO (`start`: bytes
    already read past it); each line bounded by `MAX_LINE_BYTES`, until the connection ends."""
    for raw in listener.bounded_lines(conn, start, MAX_LINE_BYTES):
        kind, _, text = raw.decode("utf-8", errors="replace").partition(" ")
        yield kind, text


def exit_code(text: str) -> int:
    """The exit code of an X message; -1 for anything that is not a plain integer."""
    try:
        return int(text) if len(text) <= 20 else -1
    except ValueError:
        return -1


def abort(reason: str) -> bytes:
    """The ABORT message that tells a task to kill its training process."""
    return f"ABORT {reason}\n".encode()


# -- the task's end ---------------------------------------------------------------------------
class _Busy(Exception):
    """The server dropped this connection before authentication because it was full: retry."""


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
        self._sock: socket.socket | None = None
        hello = f"HELLO {token} {rank} {label}\n".encode()
        deadline = time.monotonic() + 3 * timeout
        while True:
            try:
                self._sock = self._handshake(host, port, hello, timeout)
                break
            except _Busy as exc:  # dropped in a flood of other connections: try again for a while
                if time.monotonic() + 0.2 >= deadline:
                    self.error = f"the driver's log server at {host}:{port} stayed busy: {exc}"
                    break
                time.sleep(0.2)
            except OSError as exc:
                self.error = f"cannot reach the driver's log server at {host}:{port}: {exc}"
                break
        if self._sock is None:
            log.warning("%s; task output stays in this executor's stderr", self.error)
            return
        self.connected = True
        threading.Thread(target=self._read_loop, name="stratkit-log-abort", daemon=True).start()

    @staticmethod
    def _handshake(host: str, port: int, hello: bytes, timeout: float) -> socket.socket:
        """Connect, send HELLO, wait for OK. Raises _Busy (retry) or OSError (give up)."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reply = listener.greet(sock, hello)  # exactly one short line: ABORT may follow
        except (TimeoutError, ConnectionResetError) as exc:
            sock.close()
            raise _Busy(str(exc) or type(exc).__name__) from None
        except BaseException:
            sock.close()
            raise
        if reply == OK:
            sock.settimeout(None)
            return sock
        sock.close()
        if reply == BUSY:
            raise _Busy("too many connections")
        raise ConnectionRefusedError(errno.ECONNREFUSED, "the driver refused this task's token")

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
        text = pump.cut_line(text.replace("\n", " "))
        if not self._send(f"L {text}\n"):
            sys.stderr.write(f"[{self.label}] {text}\n")

    def notice(self, signal_name: str) -> None:
        """Report that a preemption notice was passed on to the training process (it saves, then exits 75)."""
        self._send(f"N {pump.cut_line(signal_name)}\n")

    def exit_code(self, code: int) -> None:
        """Report the training process's exit code."""
        self._send(f"X {code}\n")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            listener.shut(sock)
            sock.close()
