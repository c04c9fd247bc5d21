"""One node's end of the multi-node rendezvous (`NodeLink`): join, heartbeats, its result, the decision.

The wire format and the server are `stratkit.launch.rendezvous`'s. Every node,
the serving one included, joins through this class: connect and authenticate
with STRATKIT_RDZV_TOKEN (retrying until --rdzv-timeout while the serving node
is not up yet), send its address and held ports, wait for the cluster; then a
heartbeat every `HEARTBEAT` s, and a reader that records the decision, or the
loss of the rendezvous (closed, or silent for `LOST_AFTER` s).

Imports no TensorFlow.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from stratkit import timeline
from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.launch.rendezvous import (
    HEARTBEAT,
    LOST_AFTER,
    MAX_MESSAGE,
    TOKEN_VAR,
    failure_from_json,
    failure_to_json,
    message,
    node_layout,
    parse,
)
from stratkit.process import listener
from stratkit.process.report import TaskFailure


class NodeLink:
    """One node's connection to the rendezvous: join, then heartbeats, its result and the decision.

    `join()` returns once the cluster formed; then `decision` (a TaskFailure, or
    False for success) is set when the server decided, or `lost` says why the
    rendezvous is gone.
    """

    def __init__(self, host: str, port: int, token: bytes, *, serving: bool, workers_per_node: int,
                 join_timeout: float, say: Any = None, chief: bool = False, ps: int = 0, gpus: int = 0) -> None:
        self.endpoint = layout.format_address(host, port)
        self.host, self.port, self.token = host, port, token
        self.serving, self.workers_per_node, self.join_timeout = serving, workers_per_node, join_timeout
        self.say = say or (lambda text: None)
        self.sock: socket.socket | None = None
        self.node: int = -1
        self.cluster: dict[str, list[str]] = {}
        self.hosts: list[str] = []
        self.layout = node_layout(workers_per_node, chief, ps)
        #: GPUs this node shows (the rendezvous refuses a cluster whose nodes differ).
        self.gpus = gpus
        #: This node's tasks, from the rendezvous (`layout.node_tasks`), and the run's marker directory.
        self.tasks: list[layout.Task] = []
        self.run_dir = ""
        self.address = ""
        self.decision: TaskFailure | bool | None = None
        self.lost: str | None = None
        #: The decision's: every node starts the next attempt.
        self.restart = False
        #: --nnodes MIN:MAX: the round the rendezvous put this node in, the membership change that led to it
        #: ("world size 2 -> 1: ..."), and the change that ends the running round (every node restarts).
        self.round = 0
        self.change: str | None = None
        self.resize: str | None = None
        #: The change includes a node that vanished (lost without saving): the tasks wait on a peer that is gone.
        self.vanished = False
        #: This launcher's identity for the rendezvous (the same in each of its rounds).
        self.uid = f"{socket.gethostname()[:32]}-{os.getpid()}"
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._decided = threading.Event()

    # -- joining ----------------------------------------------------------------------------------
    def connect(self, attempt: int) -> str:
        """Connect and authenticate (retrying until the join timeout); returns this node's task address."""
        deadline = time.monotonic() + self.join_timeout
        told = False
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(10.0, self.join_timeout))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"--rdzv-endpoint {self.endpoint}: no rendezvous answered within "
                                      f"--rdzv-timeout {self.join_timeout:g} s ({exc}). Fix: start stratkit launch "
                                      "with the same --rdzv-endpoint on the host that owns that address, or raise "
                                      "--rdzv-timeout") from None
                if not told:
                    self.say(f"waiting for the rendezvous at {self.endpoint} (up to --rdzv-timeout "
                             f"{self.join_timeout:g} s)")
                    told = True
                time.sleep(0.5)
                continue
            reply = self._hello(sock, attempt)
            if reply == listener.OK:
                break
            sock.close()
            if reply == listener.BUSY and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise ConfigError(f"the rendezvous at --rdzv-endpoint {self.endpoint} refused this node: its "
                              f"{TOKEN_VAR} differs from the serving node's (or this is attempt {attempt + 1} and "
                              f"the serving node allows fewer: a smaller --max-restarts). Fix: set the same "
                              f"{TOKEN_VAR} (and --max-restarts) on every node; if another program holds that port on the "
                              "serving host, choose a free port for --rdzv-endpoint")
        sock.settimeout(LOST_AFTER)
        self.sock = sock
        self.address = sock.getsockname()[0]
        threading.Thread(target=self._heartbeats, name="stratkit-rdzv-heartbeat", daemon=True).start()
        return self.address

    def _hello(self, sock: socket.socket, attempt: int) -> bytes:
        label = socket.gethostname().replace(" ", "_")[:64] or "node"
        try:
            sock.settimeout(listener.HELLO_TIMEOUT + 5)
            return listener.greet(sock, f"HELLO {self.token.decode()} {attempt} {label}\n".encode())
        except OSError:
            return b""

    def join(self, ports: list[int]) -> None:
        """Send this node's ports; wait for the cluster (until the join timeout)."""
        assert self.sock is not None
        self.send("JOIN", {"serving": self.serving, "host": self.address, "ports": ports, "layout": self.layout,
                           "id": self.uid, "gpus": self.gpus})
        deadline = time.monotonic() + self.join_timeout
        self._lines = listener.bounded_lines(self.sock, b"", MAX_MESSAGE)
        try:
            for raw in self._lines:
                kind, data = parse(raw)
                if kind == "CLUSTER":
                    self.node, self.cluster, self.hosts = int(data["node"]), data["cluster"], list(data["hosts"])
                    self.tasks = [layout.Task(str(role), int(index)) for role, index in data["tasks"]]
                    self.run_dir = str(data["run_dir"])
                    self.round, self.change = int(data.get("round") or 0), data.get("change")
                    timeline.mark("rdzv: round formed")
                    break
                if kind == "END":  # an elastic rendezvous ended below MIN before this round formed
                    self._decide(data)
                    return
                if kind == "MISMATCH":  # the nodes' GPUs differ: the server's text names them and the fix
                    raise ConfigError(str(data))
                if kind == "REFUSED":
                    raise ConfigError(f"the rendezvous at --rdzv-endpoint {self.endpoint} refused this node: "
                                      f"{data}. Fix: start each node once, with the same --nnodes, "
                                      "--workers-per-node, --chief and --ps")
                if time.monotonic() > deadline:
                    raise ConfigError(f"not all nodes joined the rendezvous at {self.endpoint} within "
                                      f"--rdzv-timeout {self.join_timeout:g} s. Fix: start stratkit launch on every "
                                      "node (the same --nnodes, --rdzv-endpoint and token), or raise --rdzv-timeout")
            else:
                raise ConfigError(f"the rendezvous at {self.endpoint} closed before every node joined (the serving "
                                  "node stopped?). Fix: start every node again")
        except (TimeoutError, OSError) as exc:
            raise ConfigError(f"lost the rendezvous at {self.endpoint} while joining ({exc}). Fix: check that "
                              "the serving node still runs, and start every node again") from None
        threading.Thread(target=self._read, name="stratkit-rdzv-reader", daemon=True).start()

    # -- after the cluster formed -----------------------------------------------------------------
    def _read(self) -> None:
        why = "the rendezvous (node 0's launcher) closed the connection (it ended or was killed)"
        try:
            for raw in self._lines:
                kind, data = parse(raw)
                if kind == "END":
                    self._decide(data)
                    return
        except TimeoutError:
            why = f"no heartbeat from the rendezvous (node 0) for {LOST_AFTER:g} s (its host is gone?)"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = f"the connection to the rendezvous (node 0) failed ({type(exc).__name__}: {exc})"
        if not self._closed.is_set():
            self.lost = why
        self._decided.set()

    def _decide(self, data: Any) -> None:
        timeline.mark("rdzv: round ended")
        failure = data.get("failure")
        self.decision = False if failure is None else failure_from_json(failure)
        self.restart = bool(data.get("restart"))
        self.resize = data.get("resize") or None
        self.vanished = bool(data.get("vanished"))
        self._decided.set()

    def lost_failure(self) -> TaskFailure:
        return TaskFailure(f"node 0 ({self.host})", None, ended=f"lost: {self.lost}")

    def send(self, kind: str, data: Any = None) -> bool:
        with self._send_lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(message(kind, data))
                return True
            except OSError:
                return False

    def report(self, failure: TaskFailure | None, final: bool = False) -> None:
        """This node's tasks ended: DONE, or FAILED with the failure; `final`: no restart after this attempt."""
        if failure is None:
            self.send("DONE", {"final": final})
        else:
            self.send("FAILED", {"failure": failure_to_json(failure), "final": final})

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the decision (or the loss); True once there is one."""
        return self._decided.wait(timeout)

    def _heartbeats(self) -> None:
        while not self._closed.wait(HEARTBEAT):
            if not self.send("HB"):
                return

    def close(self) -> None:
        self._closed.set()
        with self._send_lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            listener.shut(sock)
            sock.close()
