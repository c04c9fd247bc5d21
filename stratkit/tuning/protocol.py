"""What a tuner and the search service say to each other, and the tuner's end of the connection.

The service listens through `stratkit.process.listener.AuthListener` (the one
rule for who may talk to a stratkit server: the run's token in a HELLO,
compared in constant time, one selector thread for the unauthenticated,
bounded lines); an authenticated connection then carries requests and replies,
one at a time, as JSON lines:

    tuner -> service   HELLO <token> <tuner> <label>         the listener's first line
    service -> tuner   OK                                    (else the connection is closed)
    tuner -> service   {"id": n, "op": <op>, ...}            a request (ops: `stratkit.tuning.service`)
    service -> tuner   {"id": n, "ok": {...}}                its reply
                       {"id": n, "error": <text>, "kind": "config" | "failed" | "protocol"}

Each line is at most `MAX_MESSAGE` bytes (a planner's pickled state at registration
is the largest). Every request may be sent again after a lost connection: the
service answers a repeated one as it answered the first (`stratkit.tuning.service`),
so `Connection` reconnects and resends on its own, for at most `connect_seconds`.

Imports no TensorFlow.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError, StratkitError
from stratkit.process import listener

#: Longest line either way (a pickled KerasTuner oracle is ~10 KB; a final summary of 1000 trials a few MB).
MAX_MESSAGE = 64 * 2**20
#: Seconds a reply may take (the longest: `next`, which the service holds up to `service.WAIT_SLICE`).
REPLY_SECONDS = 120.0

log = status.logger(__name__)


class SearchUnreachable(StratkitError, RuntimeError):
    """A tuner could not reach the search service (or lost it) for longer than it may wait."""


class SearchFailed(StratkitError, RuntimeError):
    """The search ended with an error (the planner's own), the same on every tuner; or one request failed."""


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":"), allow_nan=True) + "\n").encode()


def decode(raw: bytes) -> dict[str, Any]:
    message = json.loads(raw.decode("utf-8"))
    if not isinstance(message, dict):
        raise ValueError("a message is a JSON object")
    return message


def raise_for(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply's result, or the error it carries raised (ConfigError for "config", else SearchFailed)."""
    if "error" in reply:
        if reply.get("kind") == "config":
            raise ConfigError(str(reply["error"]))
        raise SearchFailed(str(reply["error"]))
    result = reply.get("ok")
    return result if isinstance(result, dict) else {}


# -- the service's end of one connection --------------------------------------------------------
def serve(conn: socket.socket, rest: bytes, handle: Callable[[dict[str, Any]], dict[str, Any]],
          closing: threading.Event) -> None:
    """Answer the requests arriving on an authenticated connection until it closes (or `closing` is set).

    `handle(request)` returns the reply (without its id). A line that is not a
    request gets a "protocol" error; the connection stays (a buggy peer is
    told, not dropped in silence).
    """
    try:
        conn.sendall(listener.OK)
        for raw in listener.bounded_lines(conn, rest, MAX_MESSAGE):
            if closing.is_set():
                return
            try:
                request = decode(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                conn.sendall(encode({"id": None, "error": f"not a request: {exc}", "kind": "protocol"}))
                continue
            reply = handle(request)
            conn.sendall(encode({"id": request.get("id"), **reply}))
    except OSError:
        pass
    finally:
        listener.shut(conn)
        conn.close()


# -- the tuner's end ------------------------------------------------------------------------------
class _Answered(Exception):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__("answered without the service")
        self.reply = reply


class Connection:
    """One tuner's connection to the service: requests in order, reconnecting for at most `connect_seconds`.

    Args:
        address: the service's (host, port).
        token: the search's token.
        tuner: this tuner's number (the HELLO's number) and `label` (its label).
        connect_seconds: how long to keep trying to reach the service, at the start (it may still be
            starting: a slow chief) and after a lost connection (a restarted chief).
        on_connect: called after each (re)connection, e.g. to register again with a restarted service.
    """

    def __init__(self, address: tuple[str, int], token: str, tuner: int, label: str, *,
                 connect_seconds: float, reply_seconds: float = REPLY_SECONDS) -> None:
        self.address = address
        self._hello = f"HELLO {token} {tuner} {label.replace(' ', '-')}\n".encode()
        self.connect_seconds = connect_seconds
        self.reply_seconds = reply_seconds
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._lines: Iterator[bytes] | None = None
        self._next_id = 0
        self._closed = False
        #: (Re)connections made so far (1 after the first).
        self.connections = 0

    @property
    def where(self) -> str:
        host, port = self.address
        return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"

    def _connect(self, deadline: float, fallback: Callable[[], dict[str, Any] | None] | None = None) -> None:
        delay = 0.05
        last = "no attempt"
        while not self._closed:
            try:
                sock = socket.create_connection(self.address, timeout=min(10.0, max(1.0, deadline - time.monotonic())))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reply = listener.greet(sock, self._hello)
                if reply == listener.OK:
                    sock.settimeout(self.reply_seconds)
                    self._sock = sock
                    self._lines = listener.bounded_lines(sock, b"", MAX_MESSAGE)
                    self.connections += 1
                    return
                sock.close()
                if reply != listener.BUSY:
                    raise ConfigError(f"the search service at {self.where} refused this tuner's token "
                                      f"(STRATKIT_TUNE_TOKEN). Fix: start every tuner from the same engine run "
                                      "(stratkit launch --tune, LocalRunner(tune=True))")
                last = "the service was busy"
            except OSError as exc:
                last = exc.strerror or str(exc) or type(exc).__name__
                if exc.errno not in (None, errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNABORTED, errno.EPIPE):
                    last = f"{last} (errno {exc.errno})"
            answer = fallback() if fallback is not None else None
            if answer is not None:
                raise _Answered(answer)
            if time.monotonic() + delay > deadline:
                raise SearchUnreachable(
                    f"could not reach the search service at {self.where} for {self.connect_seconds:g} s ({last}). "
                    "The process hosting it (the launcher's worker 0, or the driver) did not start it, or it "
                    "ended. Fix: look at that process's output; raise STRATKIT_TUNE_CONNECT_SECONDS for a slow start")
            time.sleep(delay)
            delay = min(1.0, delay * 2)
        raise SearchUnreachable("the connection to the search service was closed")

    def _drop(self) -> None:
        if self._sock is not None:
            listener.shut(self._sock)
            self._sock.close()
        self._sock, self._lines = None, None

    def request(self, op: str, *, fallback: Callable[[], dict[str, Any] | None] | None = None,
                **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply (resent after a lost connection, for `connect_seconds`).

        `fallback()`, asked after each failed attempt to reach the service, may answer instead (a reply
        dict): a tuner asking for its next trial after the host ended the search and left reads the end
        from the search's store.

        Raises:
            SearchUnreachable: the service could not be reached in time.
        """
        with self._lock:
            self._next_id += 1
            message = encode({"id": self._next_id, "op": op, **fields})
            deadline = time.monotonic() + self.connect_seconds
            while True:
                if self._sock is None:
                    try:
                        self._connect(deadline, fallback)
                    except _Answered as answered:
                        return answered.reply
                assert self._sock is not None and self._lines is not None
                try:
                    self._sock.sendall(message)
                    while True:
                        reply = decode(next(self._lines))
                        if reply.get("id") == self._next_id:
                            return reply
                except (OSError, StopIteration, ValueError) as exc:
                    log.debug("lost the search service at %s (%s): reconnecting", self.where, exc)
                    self._drop()
                    if self._closed:
                        raise SearchUnreachable("the connection to the search service was closed") from None
                    if time.monotonic() > deadline:
                        raise SearchUnreachable(f"lost the search service at {self.where} and could not reach it "
                                                f"again within {self.connect_seconds:g} s") from None

    def close(self) -> None:
        self._closed = True
        sock = self._sock
        if sock is not None:
            listener.shut(sock)


__all__ = ["MAX_MESSAGE", "Connection", "SearchFailed", "SearchUnreachable", "decode", "encode", "raise_for",
           "serve"]
