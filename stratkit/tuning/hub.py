"""The run's listener: one authenticated port for every search of a tune run, each request to its search.

A script may search several times (a RandomSearch, then a Hyperband): each
`stratkit.tune(...)` call is search number 0, 1, ... in every tuner alike (the
same script), and each has its own `SearchService`. The host keeps one
`SearchHub` for the run: one `AuthListener` (the run's token in the HELLO, the
one rule of `stratkit.process.listener`) on the port the engine chose, one
thread per authenticated connection (at most `4 * tuners + 16`), and each
request goes to the search its "search" field names:

* a search this process already hosts: its service answers;
* the host's own script has not reached that search yet (a fast tuner): the
  reply's kind is "retry", and the tuner asks again (bounded by its
  connect time);
* an engine's driver (`create`): the search is made on first use (its store
  comes with the first tuner that registers), as `LocalRunner(tune=True)` does.

A tuner's last connection to a search closing (its process died) shortens its
lease there (`SearchService.disconnected`).

Imports no TensorFlow.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from stratkit.process import listener as listener_lib
from stratkit.tuning import protocol
from stratkit.tuning.service import SearchService


class SearchHub:
    """The searches of one run behind one listener (see the module's docstring).

    Args:
        host, port: where to listen (port 0: a free one; `address` says which).
        token: the run's token.
        tuners: how many tuners the run has (bounds the connections).
        create: makes search number k on its first request (an engine's driver); None: the host adds its
            searches itself (`add`).
    """

    def __init__(self, host: str, port: int, token: str, *, tuners: int,
                 create: Callable[[int], SearchService] | None = None) -> None:
        self._services: dict[int, SearchService] = {}
        self._create = create
        self._lock = threading.Lock()
        self._connections = 0
        self._limit = 4 * max(1, int(tuners)) + 16
        self._closing = threading.Event()
        self._listener = listener_lib.AuthListener(host, port, token.encode("ascii"), self._admit,
                                                   on_fatal=self._fatal)
        self.address: tuple[str, int] = (host, self._listener.port)

    @property
    def rejected(self) -> int:
        """Connections refused (a wrong token, a bad HELLO, too many)."""
        return self._listener.rejected

    def add(self, index: int, service: SearchService) -> None:
        with self._lock:
            self._services[index] = service

    def service(self, index: int) -> SearchService | None:
        with self._lock:
            return self._services.get(index)

    def _fatal(self, why: str) -> None:
        with self._lock:
            services = list(self._services.values())
        for service in services:
            service.fail("failed", f"the search service stopped listening: {why}")

    def _admit(self, conn: socket.socket, tuner: int, label: str, rest: bytes) -> None:
        with self._lock:
            busy = self._connections >= self._limit
            if not busy:
                self._connections += 1
        if busy:
            self._listener.reject(conn, listener_lib.BUSY)
            return
        used: set[int] = set()

        def handle(request: dict[str, Any]) -> dict[str, Any]:
            index = request.get("search", 0)
            if not isinstance(index, int) or index < 0:
                return {"error": f"not a search number: {index!r}", "kind": "protocol"}
            with self._lock:
                service = self._services.get(index)
                if service is None and self._create is not None:
                    service = self._services[index] = self._create(index)
            if service is None:
                return {"error": f"search {index} has not started on its host yet", "kind": "retry"}
            if index not in used:
                used.add(index)
                service.connected(tuner)
            return service.handle(tuner, request)

        def run() -> None:
            try:
                protocol.serve(conn, rest, handle, self._closing)
            finally:
                for index in used:
                    self._services[index].disconnected(tuner)
                with self._lock:
                    self._connections -= 1

        threading.Thread(target=run, name=f"stratkit-search-{label}", daemon=True).start()

    def close(self) -> None:
        """Stop listening and every search's lease clock (their states are on their stores)."""
        self._closing.set()
        self._listener.close()
        with self._lock:
            services = list(self._services.values())
        for service in services:
            service.close()


__all__ = ["SearchHub"]
