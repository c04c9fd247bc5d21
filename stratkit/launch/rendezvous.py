"""The rendezvous of a multi-node launch: which node is which, the one TF_CONFIG cluster, and who failed.

`stratkit launch --nnodes N --rdzv-endpoint HOST:PORT` runs on every node. The
launcher that can bind HOST:PORT serves the rendezvous (`RendezvousServer`, node
0, here, with the wire format both ends speak); every launcher, node 0's
included, joins it over TCP (`stratkit.launch.nodelink.NodeLink`). Who may
connect is `stratkit.process.listener.AuthListener`'s rule: a HELLO with the
shared token from STRATKIT_RDZV_TOKEN, compared in constant time before any
other byte is trusted, one selector thread for the unauthenticated, bounded
lines. An authenticated node gets one thread (at most N).

Protocol (UTF-8 lines, each at most `MAX_MESSAGE` bytes; JSON after the kind):
    node -> server   HELLO <token> <attempt> <hostname>   (the listener's)
    server -> node   OK                                   the token matched (else: closed)
    node -> server   JOIN {"serving", "host", "ports"}    this node's task address and held ports
    server -> node   CLUSTER {"node", "nnodes", "cluster", "hosts"}   once all N joined
    both ways        HB                                   every `HEARTBEAT` s
    node -> server   DONE {} | FAILED {failure}           how this node's tasks ended
    server -> node   END {"failure": failure | null}      the decision every node reports
    server -> node   REFUSED <why>                        e.g. the rendezvous is full

Node ranks: the serving node is 0, the others in the order they joined. The
cluster is `stratkit.cluster.layout`'s (workers only: node r runs workers
r*K .. r*K+K-1), built here once and checked by every node for its own tasks.

A node is lost when its connection closes (its launcher died: at once) or it
is silent for `LOST_AFTER` s (its host is gone); that is a failure of the run.
The decision: the first failure reported, or a crash reported within `SETTLE`
s of it (the launcher's root-cause rule); every node then stops its tasks and
ends with that failure's exit status.

Imports no TensorFlow.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.process import listener
from stratkit.process.report import TaskFailure

TOKEN_VAR = "STRATKIT_RDZV_TOKEN"
#: Seconds between heartbeats, both ways.
HEARTBEAT = 1.0
#: Seconds of silence after which a peer is lost (its host gone, or the network between).
LOST_AFTER = 10.0
#: After the first failure, how long a crash elsewhere can still become the root cause.
SETTLE = 1.0
#: Longest message: a failure carries a task's last lines (50 of at most 8000 characters, JSON-escaped).
MAX_MESSAGE = 4 * 2**20
MIN_TOKEN = 16


def check_token(value: str | None) -> bytes:
    """STRATKIT_RDZV_TOKEN as the listener compares it; a ConfigError naming the variable when unusable."""
    fix = (f"Fix: export {TOKEN_VAR}=$(python -c 'import secrets; print(secrets.token_hex(16))') and set the same "
           "value on every node")
    if not value:
        raise ConfigError(f"{TOKEN_VAR} is not set: --nnodes needs a shared secret every node presents to the "
                          f"rendezvous. {fix}")
    if len(value) < MIN_TOKEN or not value.isascii() or not value.isprintable() or " " in value:
        raise ConfigError(f"{TOKEN_VAR} must be at least {MIN_TOKEN} printable ASCII characters without spaces "
                          f"(got {len(value)} character(s)). {fix}")
    return value.encode("ascii")


def failure_to_json(failure: TaskFailure) -> dict[str, Any]:
    return asdict(failure)


def failure_from_json(data: Any) -> TaskFailure:
    """A TaskFailure from a peer's message (authenticated, but read field by field)."""
    if not isinstance(data, dict):
        raise ValueError("a failure is an object")
    known = {f.name for f in fields(TaskFailure)}
    values = {k: v for k, v in data.items() if k in known}
    for key in ("last_lines", "exception"):
        values[key] = tuple(str(x) for x in values.get(key) or ())
    return TaskFailure(**values)


def _rank(item: tuple[int, TaskFailure]) -> tuple[bool, int]:
    """A crash (a death by signal) beats an exit code; then the first reported (as `AttemptRunner.root_cause_rank`)."""
    order, failure = item
    code = failure.returncode or 0
    return not (code < 0 or 128 < code < 160), order


def message(kind: str, data: Any = None) -> bytes:
    return (kind + ("" if data is None else " " + json.dumps(data)) + "\n").encode()


def parse(raw: bytes) -> tuple[str, Any]:
    kind, _, text = raw.decode("utf-8", errors="replace").partition(" ")
    if kind in ("JOIN", "CLUSTER", "DONE", "FAILED", "END"):
        return kind, json.loads(text) if text else None
    return kind, text


@dataclass
class _Node:
    conn: socket.socket
    label: str
    serving: bool = False
    host: str = ""
    ports: tuple[int, ...] = ()
    rank: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, data: bytes) -> bool:
        with self.lock:
            try:
                self.conn.sendall(data)
                return True
            except OSError:
                return False


class RendezvousServer:
    """Node 0's rendezvous: bound to `host`:`port` only (raises OSError when this machine cannot bind it)."""

    def __init__(self, host: str, port: int, token: bytes, nnodes: int, workers_per_node: int) -> None:
        self.nnodes, self.workers_per_node = nnodes, workers_per_node
        self._lock = threading.Lock()
        self._nodes: list[_Node] = []  # joined, in join order
        self.formed = False
        self.decision: dict[str, Any] | None = None
        self._failures: list[tuple[int, TaskFailure]] = []
        self._done: set[int] = set()
        self._closing = threading.Event()
        self._listener = listener.AuthListener(host, port, token, self._admit)
        threading.Thread(target=self._heartbeats, name="stratkit-rdzv-heartbeat", daemon=True).start()

    def _admit(self, conn: socket.socket, attempt: int, label: str, rest: bytes) -> None:
        with self._lock:
            full = len(self._nodes) >= self.nnodes or self.formed
        if full:
            self._listener.reject(conn, b"REFUSED the rendezvous already has its nodes\n")
            return
        threading.Thread(target=self._serve_node, args=(conn, label, rest), name="stratkit-rdzv-node",
                         daemon=True).start()

    def _serve_node(self, conn: socket.socket, label: str, rest: bytes) -> None:
        node = _Node(conn, label)
        conn.settimeout(LOST_AFTER)
        joined = False
        why = "its launcher's connection closed (the launcher ended or was killed)"
        try:
            node.send(listener.OK)
            for raw in listener.bounded_lines(conn, rest, MAX_MESSAGE):
                kind, data = parse(raw)
                if kind == "JOIN" and not joined:
                    joined = self._join(node, data)
                    if not joined:
                        return
                elif kind == "DONE" and node.rank is not None:
                    self._finished(node.rank, None)
                elif kind == "FAILED" and node.rank is not None:
                    self._finished(node.rank, failure_from_json(data))
        except TimeoutError:
            why = f"no heartbeat for {LOST_AFTER:g} s (its host is gone, or the network between)"
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a broken peer is a lost node, never a crash here
            why = f"its connection failed ({type(exc).__name__}: {exc})"
        finally:
            conn.close()
            self._gone(node, why)

    def _join(self, node: _Node, data: Any) -> bool:
        try:
            node.serving, node.host = bool(data["serving"]), str(data["host"])
            node.ports = tuple(int(p) for p in data["ports"])
        except (KeyError, TypeError, ValueError):
            node.send(b"REFUSED a malformed JOIN\n")
            return False
        with self._lock:
            others = [n for n in self._nodes if not n.serving]
            if self.formed or len(node.ports) != self.workers_per_node or (
                    not node.serving and len(others) >= self.nnodes - 1):
                refused = True
            else:
                refused = False
                self._nodes.append(node)
                ready = len(self._nodes) == self.nnodes
        if refused:
            node.send(f"REFUSED the rendezvous has its {self.nnodes} node(s), or this node's "
                      f"--workers-per-node differs from the serving node's {self.workers_per_node}\n".encode())
            return False
        if ready:
            self._form()
        return True

    def _form(self) -> None:
        with self._lock:
            nodes = sorted(self._nodes, key=lambda n: not n.serving)  # stable: the others in join order
            for rank, node in enumerate(nodes):
                node.rank = rank
            self._nodes = nodes
            self.formed = True
        tasks = layout.plan_tasks(self.nnodes * self.workers_per_node)
        addresses = [layout.format_address(n.host, p) for n in nodes for p in n.ports]
        cluster = layout.build_cluster(tasks, addresses)
        hosts = [n.host for n in nodes]
        for node in nodes:
            node.send(message("CLUSTER", {"node": node.rank, "nnodes": self.nnodes, "cluster": cluster,
                                           "hosts": hosts}))

    def _gone(self, node: _Node, why: str) -> None:
        with self._lock:
            if not self.formed:
                if node in self._nodes:
                    self._nodes.remove(node)  # left before the cluster formed: its place is free again
                return
            if node.rank is None or self.decision is not None or node.rank in self._done:
                return
        self._finished(node.rank, TaskFailure(f"node {node.rank} ({node.host})", None, ended=f"lost: {why}"))

    def _finished(self, rank: int, failure: TaskFailure | None) -> None:
        with self._lock:
            if self.decision is not None or rank in self._done:
                return
            self._done.add(rank)
            if failure is None:
                if len(self._done) == self.nnodes and not self._failures:
                    self._decide()
                return
            self._failures.append((len(self._failures), failure))
            first = len(self._failures) == 1
        if first:
            threading.Timer(SETTLE, self._settle).start()

    def _settle(self) -> None:
        with self._lock:
            self._decide()

    def _decide(self) -> None:
        """Called with the lock held: the decision, once, to every node."""
        if self.decision is not None:
            return
        failure = min(self._failures, key=_rank)[1] if self._failures else None
        self.decision = {"failure": None if failure is None else failure_to_json(failure)}
        end = message("END", self.decision)
        for node in self._nodes:
            node.send(end)

    def _heartbeats(self) -> None:
        while not self._closing.wait(HEARTBEAT):
            with self._lock:
                nodes = list(self._nodes)
            for node in nodes:
                node.send(b"HB\n")

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            nodes = list(self._nodes)
        for node in nodes:
            try:
                node.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
