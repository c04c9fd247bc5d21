"""An authenticated TCP listener with limits: the one place that decides who may talk to a stratkit server.

Two servers use it: the Spark driver's log server (`stratkit.spark.logserver`)
and the multi-node launch's rendezvous (`stratkit.launch.rendezvous`). Both
listen where other machines can reach them, so both need the same guarantees,
decided here once:

  * a peer's first line is `HELLO <token> <number> <label>`; the token is compared
    in constant time (`hmac.compare_digest`) before any other byte is decoded or
    trusted; anything else closes the connection (`check_hello`);
  * unauthenticated connections are served by one selector thread, never a
    thread each; the HELLO must arrive whole within `HELLO_TIMEOUT` seconds
    (not per byte: a trickle cannot extend it) and `MAX_HELLO` bytes; at most
    `MAX_PENDING` wait at once (the oldest is dropped with BUSY for a new one,
    so a flood cannot lock the real peers out);
  * lines after the HELLO are bounded (`bounded_lines`): an over-long line is cut
    and the rest of it dropped, so memory stays bounded whatever a peer sends;
  * accept() errors such as "too many open files" are retried with backoff; an
    error the listener cannot recover from calls `on_fatal` once, with the reason.

What an authenticated connection then carries is each server's own protocol:
`admit(conn, number, label, rest)` is called (from the selector thread) with the
connection, blocking again, and the bytes already read past the HELLO.

Imports no TensorFlow.
"""

from __future__ import annotations

import errno
import hmac
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

#: Seconds a connection has to deliver its whole HELLO.
HELLO_TIMEOUT = 10.0
#: Longest HELLO line ("HELLO <32 hex digits> <number> <label>" is under 100 bytes).
MAX_HELLO = 512
#: Unauthenticated connections held at once.
MAX_PENDING = 64
#: Seconds accept() may keep failing (e.g. EMFILE) before the listener gives up and reports it fatal.
ACCEPT_GIVE_UP = 60.0

OK = b"OK\n"
BUSY = b"BUSY\n"

# accept() errors that concern one connection, or resources that come back: retry (see accept(2)).
_RETRY_NOW = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT, errno.EHOSTDOWN,
              errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.ETIMEDOUT,
              getattr(errno, "ENONET", errno.ENETDOWN)}
_RETRY_LATER = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def shut(conn: socket.socket) -> None:
    """End both directions of `conn` now (a blocked reader on it wakes up); it may already be gone."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def greet(sock: socket.socket, hello: bytes) -> bytes:
    """The client's side of the HELLO: send `hello` on `sock` and return the server's one short reply line (OK,
    BUSY, another server's word) read byte by byte, so nothing that follows it is consumed; b"" when closed."""
    sock.sendall(hello)
    reply = b""
    while not reply.endswith(b"\n") and len(reply) < 8:
        data = sock.recv(1)
        if not data:
            break
        reply += data
    return reply


def check_hello(line: bytes, token: bytes, max_number: int | None) -> tuple[int, str] | None:
    """(number, label) from a HELLO line (without its newline), or None. Bytes only until the token matched.

    A number outside 0..max_number-1 is refused (no check when `max_number` is None).
    """
    parts = line.rstrip(b"\r").split(b" ", 3)
    if len(parts) != 4 or parts[0] != b"HELLO":
        return None
    if not hmac.compare_digest(parts[1], token):  # constant time for any bytes, any length
        return None
    number_text = parts[2]
    if not (number_text.isdigit() and len(number_text) <= 6):  # bytes.isdigit(): ASCII digits only
        return None
    number = int(number_text)
    if max_number is not None and number >= max_number:
        return None
    return number, parts[3].decode("utf-8", errors="replace")


def bounded_lines(conn: socket.socket, start: bytes, limit: int) -> Iterator[bytes]:
    """The lines arriving on `conn` (without their newline); a line longer than `limit` bytes is cut to its first
    `limit` bytes and the rest of it is read and dropped, so memory stays bounded whatever the peer sends."""
    buffer = bytearray(start)
    skipping = False  # inside the dropped rest of an over-long line
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            if not skipping:
                yield bytes(buffer[:end])
            skipping = False
            del buffer[:end + 1]
            continue
        if len(buffer) > limit:
            if not skipping:
                yield bytes(buffer[:limit])
            skipping = True
            buffer.clear()
        data = conn.recv(65536)
        if not data:
            if buffer and not skipping:
                yield bytes(buffer)
            return
        buffer += data


@dataclass
class _Pending:
    """An accepted connection that has not authenticated yet."""

    conn: socket.socket
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)


class AuthListener:
    """Listens on (host, port), authenticates each connection's HELLO, hands the good ones to `admit`.

    Args:
        host, port: where to listen (port 0: a free one, then `self.port`).
        token: the secret every peer presents.
        admit: `admit(conn, number, label, rest)`, from the selector thread, for an authenticated connection.
        max_number: HELLO numbers allowed are 0..max_number-1 (None: any).
        on_fatal: called once with the reason when the listener cannot accept connections any more.
        accept_give_up: seconds of failing accept() before the failure is fatal.
        family: the address family (default: from `socket.create_server`'s choice for `host`).
    """

    def __init__(self, host: str, port: int, token: bytes, admit: Callable[[socket.socket, int, str, bytes], None],
                 *, max_number: int | None = None, on_fatal: Callable[[str], None] | None = None,
                 accept_give_up: float = ACCEPT_GIVE_UP, family: int | None = None) -> None:
        self._token = token
        self._admit = admit
        self._max_number = max_number
        self._on_fatal = on_fatal
        self._accept_give_up = accept_give_up
        self._lock = threading.Lock()
        self.rejected = 0
        #: accept() calls that failed and were retried (e.g. out of file descriptors).
        self.accept_errors = 0
        #: Why the listener stopped accepting (None while it serves); see `on_fatal`.
        self.failure: str | None = None
        self._closing = False
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self._accept_failing_since: float | None = None
        self._accept_backoff = 0.0
        self._accept_resume_at: float | None = None
        kwargs = {} if family is None else {"family": family}
        self.sock = socket.create_server((host, port), backlog=128, **kwargs)
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        # close() wakes the selector at once: closing a socket does not end an epoll wait.
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="stratkit-listener", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Connections accepted but not yet authenticated."""
        return len(self._pending)

    def _serve(self) -> None:
        try:
            while not self._closing:
                if self.sock.fileno() == -1:
                    raise OSError(errno.EBADF, "its listening socket was closed")
                now = time.monotonic()
                if self._accept_resume_at is not None and now >= self._accept_resume_at:
                    self._accept_resume_at = None
                    self._selector.register(self.sock, selectors.EVENT_READ)
                timeout = 0.2 if self._accept_resume_at is None else min(0.2, self._accept_resume_at - now)
                for key, _ in self._selector.select(max(0.0, timeout)):
                    if key.fileobj is self._wake:
                        continue  # close(): the loop's condition ends it
                    if key.fileobj is self.sock:
                        self._accept_some()
                    elif key.fileobj in self._pending:
                        self._read_hello(self._pending[key.fileobj])
                self._expire_pending(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - whatever stops this loop stops the listener: report it
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
                conn, _ = self.sock.accept()
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
            self._read_hello(pending)  # a peer sends its HELLO with the connection: often it is here already

    def _accept_failed(self, exc: OSError) -> None:
        """Out of file descriptors or memory: free what we can, pause accepting, give up after a while."""
        now = time.monotonic()
        self.accept_errors += 1
        if self._accept_failing_since is None:
            self._accept_failing_since = now
        elif now - self._accept_failing_since > self._accept_give_up:
            raise OSError(exc.errno, f"accept() kept failing for {self._accept_give_up:.0f}s: {exc.strerror}")
        if self._pending and exc.errno in (errno.EMFILE, errno.ENFILE):
            self._drop(next(iter(self._pending.values())), BUSY)  # an idle client's descriptor, for a peer
        self._accept_backoff = min(1.0, max(0.005, 2 * self._accept_backoff))
        self._selector.unregister(self.sock)  # a listening socket stays readable: pause, do not spin
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
        hello = check_hello(line, self._token, self._max_number)
        if hello is None:
            self.reject(pending.conn)
            return
        pending.conn.setblocking(True)
        self._admit(pending.conn, *hello, rest)

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
        self.reject(pending.conn, message)

    def reject(self, conn: socket.socket, message: bytes = b"") -> None:
        """Close `conn` (after sending `message`, e.g. BUSY), counted in `rejected`."""
        with self._lock:
            self.rejected += 1
        if message:
            try:
                conn.send(message)
            except OSError:
                pass
        conn.close()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        try:  # refuse new connections at once: a peer then fails fast instead of waiting in a backlog
            self.sock.close()
        except OSError:
            pass
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def close(self) -> None:
        """Stop accepting; drop the connections that have not authenticated."""
        self._closing = True
        self.sock.close()
        try:
            self._waker.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._waker.close()
