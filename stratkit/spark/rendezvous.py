"""The tasks' address exchange through the driver, instead of Spark's barrier all-gather.

Why: `BarrierTaskContext.allGather` costs at least a second however quickly
the tasks arrive (measured: 1.0-1.2 s on an idle local cluster; Spark's
barrier waits in one-second sleeps), a fifth of a warm run. The driver waits
for the tasks anyway: a small server on it takes one "host:port" per rank and
answers every task as soon as the last one arrived.

Where the executors cannot reach the driver (Spark Connect from outside the
cluster), or an answer does not come within `WAIT_SECONDS`, a task falls back
to `allGather`; a task that is still waiting gives up at the same deadline, so
all of them meet in the all-gather.

Protocol (one line each way): task -> driver `<token> <rank> <member>`;
driver -> task a JSON list of every rank's member. A member is what the task
tells the others (`stratkit.spark.task`: its address and GPU count, as JSON);
the driver passes it on as it came. The token is the run's
random secret; a wrong one, or a line longer than 1 KiB, closes the connection.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading

#: Seconds a task waits for the others' addresses before falling back to Spark's all-gather.
WAIT_SECONDS = 60.0
_CONNECT_SECONDS = 5.0
_MAX_LINE = 1024


class Rendezvous:
    """The driver's end, for one attempt of `count` tasks."""

    def __init__(self, host: str, count: int) -> None:
        self.token = secrets.token_hex(16)
        self.count = count
        self._addresses: dict[int, str] = {}
        self._waiting: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="stratkit-rendezvous", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="stratkit-rendezvous-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_CONNECT_SECONDS)
            line = conn.makefile("rb").readline(_MAX_LINE)
            token, rank, address = line.decode("utf-8", "replace").strip().split(" ", 2)
            if not hmac.compare_digest(token, self.token) or not rank.isdigit() or int(rank) >= self.count:
                raise ValueError("rejected")
        except (OSError, ValueError):
            conn.close()
            return
        with self._lock:
            self._addresses[int(rank)] = address
            self._waiting.append(conn)
            if len(self._addresses) < self.count:
                return
            answer = (json.dumps([self._addresses[r] for r in range(self.count)]) + "\n").encode()
            waiting, self._waiting = self._waiting, []
        for task in waiting:
            try:
                task.sendall(answer)
            except OSError:
                pass
            finally:
                task.close()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for conn in waiting:
            conn.close()


def exchange(host: str, port: int, token: str, rank: int, address: str,
             wait_seconds: float = WAIT_SECONDS) -> list[str] | None:
    """This task's side: every rank's address, or None when the driver cannot be asked (then all-gather)."""
    if not port:
        return None
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_SECONDS) as conn:
            conn.settimeout(wait_seconds)
            conn.sendall(f"{token} {rank} {address}\n".encode())
            reply = conn.makefile("rb").readline(1 << 20)
        addresses = json.loads(reply)
    except (OSError, ValueError):
        return None
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        return None
    return addresses
