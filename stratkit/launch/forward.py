"""A service on this machine's loopback (an MLflow tracking server), reachable from the private network.

The tasks of a local launch run in a loopback-only network namespace
(`launch/isolation.py`): its 127.0.0.1 is not the machine's, so a tracking
server at `http://127.0.0.1:5000` would be out of reach. `Forward` closes that
gap for one address: the namespace's holder binds a listener at the same
address inside the namespace and hands it to the launcher, whose accept thread
(in the machine's network) connects each accepted connection to the service;
two threads per connection copy the bytes, one each way, so a slow reader on
one side never holds up the other direction. Only the tasks can reach the
listener (nothing else is in the namespace), and it reaches only that one
service: the tasks' TensorFlow servers stay unreachable from outside.

Which address: the tasks' `MLFLOW_TRACKING_URI` when it names this machine's
loopback (`stratkit.training.tracking.handoff.loopback_server`); the supervisor
opens it with the network and says so once.

Imports no TensorFlow.
"""

from __future__ import annotations

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
        self.connections = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="stratkit-forward", daemon=True)

    def start(self) -> Forward:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop relaying: the listener and every open connection are closed."""
        with self._lock:
            self._closed = True
            sockets = [self.listener, *self._open]
            self._open.clear()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on it
            except OSError:
                pass
            sock.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                outside = socket.create_connection(self.target, timeout=_CONNECT_SECONDS)
                outside.settimeout(None)
            except OSError:  # the service is down: the task sees its connection closed
                inside.close()
                continue
            with self._lock:
                if self._closed:
                    inside.close()
                    outside.close()
                    return
                self._open.update((inside, outside))
                self.connections += 1
            done = threading.Barrier(2, action=lambda pair=(inside, outside): self._release(*pair))
            for source, sink in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._copy, args=(source, sink, done), name="stratkit-forward-copy",
                                 daemon=True).start()

    @staticmethod
    def _copy(source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
        try:
            while data := source.recv(_CHUNK):
                sink.sendall(data)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)  # the other side's end of this direction: its read sees the close
        except OSError:
            pass
        try:
            done.wait()
        except threading.BrokenBarrierError:
            pass

    def _release(self, *sockets: socket.socket) -> None:
        """Both directions ended: close the connection's two sockets."""
        with self._lock:
            for sock in sockets:
                self._open.discard(sock)
                sock.close()
