"""A service on this machine's loopback (an MLflow tracking server), reachable from the private network.

The tasks of a local launch run in a loopback-only network namespace
(`launch/isolation.py`): its 127.0.0.1 is not the machine's, so a tracking
server at `http://127.0.0.1:5000` would be out of reach. `Forward` closes that
gap for one address: the namespace's holder binds a listener at the same
address inside the namespace and hands it to the launcher, whose relay thread
(in the machine's network) connects each accepted connection to the service
and copies bytes both ways. Only the tasks can reach the listener (nothing
else is in the namespace), and it reaches only that one service: the tasks'
TensorFlow servers stay unreachable from outside.

Which address: the tasks' `MLFLOW_TRACKING_URI` when it names this machine's
loopback (`stratkit.training.tracking.handoff.loopback_server`); the supervisor
opens it with the network and says so once.

Imports no TensorFlow.
"""

from __future__ import annotations

import selectors
import socket
import threading

_CHUNK = 1 << 16
#: How long connecting to the service may take (it is on this machine).
_CONNECT_SECONDS = 10.0


class Forward:
    """Relays every connection accepted on `listener` (inside the namespace) to `target` (outside it)."""

    def __init__(self, listener: socket.socket, target: tuple[str, int]) -> None:
        self.listener = listener
        self.target = target
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, name="stratkit-forward", daemon=True)
        self.connections = 0

    def start(self) -> Forward:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop relaying: the listener and every open connection are closed."""
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        for sock in (self.listener, self._wake_read, self._wake_write, *self._peers):
            sock.close()
        self._peers.clear()
        self._selector.close()

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                sock = key.fileobj
                if sock is self._wake_read:
                    return
                if sock is self.listener:
                    self._accept()
                else:
                    self._relay(sock)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            inside, _ = self.listener.accept()
        except OSError:  # e.g. the client gave up already
            return
        try:
            outside = socket.create_connection(self.target, timeout=_CONNECT_SECONDS)
        except OSError:  # the service is down: the task sees its connection refused-like close
            inside.close()
            return
        self.connections += 1
        for sock in (inside, outside):
            sock.setblocking(True)
            sock.settimeout(None)
            self._selector.register(sock, selectors.EVENT_READ)
        self._peers[inside], self._peers[outside] = outside, inside

    def _relay(self, sock: socket.socket) -> None:
        peer = self._peers.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(_CHUNK)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        for end in (sock, peer):  # one side closed (or broke): the connection is over
            self._selector.unregister(end)
            self._peers.pop(end, None)
            end.close()
