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
    node -> server   JOIN {"serving", "host", "ports", "layout", "gpus"}   its task address, held ports, the layout
                                                         flags, how many GPUs it shows
    server -> node   CLUSTER {"node", "nnodes", "cluster", "hosts", "tasks"}   once all N joined
    server -> node   MISMATCH <why>                       instead, when the nodes' GPU counts differ (every node
                                                         ends with a ConfigError naming them)
    both ways        HB                                   every `HEARTBEAT` s
    node -> server   DONE {"final"} | FAILED {"failure", "final"}   how this node's tasks ended
    server -> node   END {"failure": failure | null, "restart"}     the decision every node follows
    server -> node   REFUSED <why>                        e.g. the rendezvous is full

Node ranks: the serving node is 0, the others in the order they joined. The
cluster is `stratkit.cluster.layout`'s, and so is which node runs which task
(`layout.node_tasks`: node r runs workers r*K .. r*K+K-1, node 0 the chief,
ps task j node (j + 1) mod N); it is built here once, sent with each node's
tasks, and checked by every node for its own tasks. Every node holds as many
ports as the busiest node needs; a node whose layout flags (--workers-per-node,
--chief, --ps) differ from the serving node's is refused.

A node is lost when its connection closes (its launcher died: at once) or it
is silent for `LOST_AFTER` s (its host is gone); that is a failure of the run.
The decision: the first failure reported, or a crash reported within `SETTLE`
s of it (the launcher's root-cause rule; a preemption, exit 75, ranks after
any other failure); every node then stops its tasks and
ends with that failure's exit status; once node 0 (worker 0) finished, the
others get its --exit-grace, then every node stops what still runs, as a
success (as locally). Or, with --max-restarts, every node
joins the next round (the attempt number is the HELLO's number) and starts
its tasks again on new ports. A preemption (the tasks saved at one step and
exited 75) restarts every node too, without counting against --max-restarts.
No restart after a node was lost, after worker 0 finished training, or after
a node was interrupted or its launcher preempted (the node says "final").

Imports no TensorFlow.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.process import listener
from stratkit.process.report import TaskFailure, is_preempted

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


def node_layout(workers_per_node: int, chief: bool = False, ps: int = 0) -> dict[str, Any]:
    """The layout flags every node must share, as a JOIN carries them."""
    return {"workers_per_node": int(workers_per_node), "chief": bool(chief), "ps": int(ps)}


def describe_layout(shape: dict[str, Any]) -> str:
    flags = f"--workers-per-node {shape['workers_per_node']}"
    return flags + (" --chief" if shape["chief"] else "") + (f" --ps {shape['ps']}" if shape["ps"] else "")


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


def _rank(item: tuple[int, TaskFailure]) -> tuple[bool, bool, int]:
    """A crash (a death by signal) beats an exit code, any failure beats a preemption (exit 75: every task
    saved at one step and left); then the first reported (as `AttemptRunner.root_cause_rank`)."""
    order, failure = item
    code = failure.returncode or 0
    return not (code < 0 or 128 < code < 160), is_preempted(code), order


def gpu_mismatch(nodes: list[_Node]) -> str:
    """Why a cluster of these nodes is refused for their GPUs ("" when every node shows as many)."""
    counts = {n.gpus for n in nodes if n.gpus is not None}
    if len(counts) <= 1:
        return ""
    shown = ", ".join(f"node {n.rank} {n.label} ({n.host}): {n.gpus} GPU(s)" for n in nodes)
    mixed = 0 in counts
    return (f"the nodes of this --nnodes cluster show different GPU counts ({shown}); "
            + ("a cluster mixing GPU and CPU-only nodes" if mixed else "nodes with different GPU counts")
            + " cannot train in one collective group (NCCL fails deep inside TensorFlow). Fix: run every node with "
            "the same number of visible GPUs (set CUDA_VISIBLE_DEVICES on the larger ones), or "
            "CUDA_VISIBLE_DEVICES= (empty) on every node to train on CPU")


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
    gpus: int | None = None  # GPUs the node shows (JOIN's "gpus")
    uid: str = ""  # the launcher's own id (JOIN's "id"): one node across rounds, also two on one host
    last_seen: float = field(default_factory=time.monotonic)  # its last line (a heartbeat at least every HEARTBEAT s)

    def send(self, data: bytes) -> bool:
        with self.lock:
            try:
                self.conn.sendall(data)
                return True
            except OSError:
                return False


@dataclass
class _Round:
    """One attempt's rendezvous: who joined, the cluster, how each node's tasks ended, the decision."""

    number: int
    nodes: list[_Node] = field(default_factory=list)  # joined, in join order (node 0 first once formed)
    formed: bool = False
    decision: dict[str, Any] | None = None
    failures: list[tuple[int, TaskFailure]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    final: bool = False  # a node said this attempt must not be restarted


class RendezvousServer:
    """Node 0's rendezvous: bound to `host`:`port` only (raises OSError when this machine cannot bind it).

    One round per attempt (`attempts` = --max-restarts + 1): a node's HELLO names its attempt.
    """

    def __init__(self, host: str, port: int, token: bytes, nnodes: int, workers_per_node: int,
                 attempts: int = 1, exit_grace: float = 30.0, chief: bool = False, ps: int = 0,
                 gpus: int | None = None) -> None:
        self.nnodes, self.workers_per_node, self.attempts = nnodes, workers_per_node, attempts
        #: The serving node's GPU count: a node showing another joins anyway, and the cluster is then refused on
        #: every node for its GPUs (with `--workers-per-node gpu` its layout differs too, for the same reason).
        self.gpus = gpus
        self.shape = node_layout(workers_per_node, chief, ps)
        self.placement = layout.node_tasks(nnodes, workers_per_node, chief, ps)
        self.slots = max(len(tasks) for tasks in self.placement)
        self.exit_grace = exit_grace
        #: Rounds started again after a preemption (exit 75): not counted against --max-restarts.
        self.preemptions = 0
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}
        self._connections = 0  # authenticated connections (one thread each), capped at 2 * nnodes
        self._closing = threading.Event()
        self._listener = listener.AuthListener(host, port, token, self._admit)
        threading.Thread(target=self._heartbeats, name="stratkit-rdzv-heartbeat", daemon=True).start()

    @property
    def rejected(self) -> int:
        return self._listener.rejected

    def round(self, number: int) -> _Round:
        with self._lock:
            return self._rounds.setdefault(number, _Round(number))

    def _round_for(self, attempt: int) -> _Round:
        """The round a node's HELLO joins: the attempt it names (an elastic rendezvous chooses itself)."""
        return self.round(attempt)

    def _admit(self, conn: socket.socket, attempt: int, label: str, rest: bytes) -> None:
        if attempt >= self.attempts + self.preemptions:  # a round this rendezvous will never hold
            self._listener.reject(conn)
            return
        round_ = self._round_for(attempt)
        with self._lock:
            full = len(round_.nodes) >= self.nnodes or round_.formed
            busy = self._connections >= 2 * self.nnodes
            if not (full or busy):
                self._connections += 1
        if full or busy:
            self._listener.reject(conn, listener.BUSY if busy and not full else
                                  b"REFUSED the rendezvous already has its nodes\n")
            return
        threading.Thread(target=self._serve_node, args=(round_, conn, label, rest), name="stratkit-rdzv-node",
                         daemon=True).start()

    def _serve_node(self, round_: _Round, conn: socket.socket, label: str, rest: bytes) -> None:
        node = _Node(conn, label)
        conn.settimeout(LOST_AFTER)
        joined = False
        why = "its launcher's connection closed (the launcher ended or was killed)"
        try:
            node.send(listener.OK)
            for raw in listener.bounded_lines(conn, rest, MAX_MESSAGE):
                node.last_seen = time.monotonic()
                kind, data = parse(raw)
                if kind == "JOIN" and not joined:
                    joined = self._join(round_, node, data)
                    if not joined:
                        return
                elif kind in ("DONE", "FAILED") and node.rank is not None:
                    failure = failure_from_json(data["failure"]) if kind == "FAILED" else None
                    self._finished(round_, node.rank, failure, bool(data.get("final")))
        except TimeoutError:
            why = f"no heartbeat for {LOST_AFTER:g} s (its host is gone, or the network between)"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a broken peer is lost, no crash
            why = f"its connection failed ({type(exc).__name__}: {exc})"
        finally:
            conn.close()
            with self._lock:
                self._connections -= 1
            self._gone(round_, node, why)

    def _join(self, round_: _Round, node: _Node, data: Any) -> bool:
        try:
            node.serving, node.host = bool(data["serving"]), str(data["host"])
            node.ports = tuple(int(p) for p in data["ports"])
            shape = data.get("layout") or node_layout(len(node.ports))
            node.gpus = None if data.get("gpus") is None else int(data["gpus"])
        except (KeyError, TypeError, ValueError, AttributeError):
            node.send(b"REFUSED a malformed JOIN\n")
            return False
        gpus_differ = None not in (node.gpus, self.gpus) and node.gpus != self.gpus
        with self._lock:
            others = [n for n in round_.nodes if not n.serving]
            refused = round_.formed or (not gpus_differ and (shape != self.shape or len(node.ports) != self.slots)) \
                or (not node.serving and len(others) >= self.nnodes - 1)
            if not refused:
                round_.nodes.append(node)
        if refused:
            node.send(f"REFUSED the rendezvous has its {self.nnodes} node(s), or this node's layout flags differ "
                      f"from the serving node's ({describe_layout(self.shape)})\n".encode())
            return False
        self._joined(round_, node)
        return True

    def _joined(self, round_: _Round, node: _Node) -> None:
        """A node joined `round_`: form the cluster once all N are in (an elastic rendezvous decides otherwise)."""
        with self._lock:
            ready = len(round_.nodes) == self.nnodes
        if ready:
            self._form(round_)

    def _cluster_extra(self, round_: _Round) -> dict[str, Any]:
        """More of the CLUSTER message (an elastic rendezvous adds the membership change)."""
        return {}

    def _form(self, round_: _Round) -> None:
        with self._lock:
            nodes = sorted(round_.nodes, key=lambda n: not n.serving)  # stable: the others in join order
            for rank, node in enumerate(nodes):
                node.rank = rank
            round_.nodes = nodes
            round_.formed = True
        mismatch = gpu_mismatch(nodes)
        if mismatch:  # before any task starts: NCCL would fail deep inside (tensorflow/tensorflow#60847)
            for node in nodes:
                node.send(f"MISMATCH {mismatch}\n".encode())
            return
        shape = self.shape
        count = len(nodes)  # all N (an elastic round: its own number of nodes)
        placement = self.placement if count == self.nnodes else layout.node_tasks(
            count, self.workers_per_node, shape["chief"], shape["ps"])
        tasks = layout.plan_tasks(count * self.workers_per_node, shape["chief"], shape["ps"])
        where = {task: layout.format_address(node.host, port) for node, mine in zip(nodes, placement)
                 for task, port in zip(mine, node.ports)}
        cluster = layout.build_cluster(tasks, [where[t] for t in tasks if t.serves])
        hosts = [n.host for n in nodes]
        # The parameter-server tasks' done markers (`stratkit.strategy.server`): one path, the same on every node.
        run_dir = os.path.join(tempfile.gettempdir(), f"stratkit-run-{secrets.token_hex(8)}")
        extra = self._cluster_extra(round_)
        for node, mine in zip(nodes, placement):
            node.send(message("CLUSTER", {"node": node.rank, "nnodes": count, "cluster": cluster,
                                           "hosts": hosts, "tasks": [[t.role, t.index] for t in mine],
                                           "run_dir": run_dir, "round": round_.number, **extra}))

    def _still_running(self, round_: _Round, node: _Node) -> bool:
        """Whether `node` leaving `round_` changes the run; call under the lock.

        Before the cluster formed, a node that leaves frees its place (and changes nothing else). After it,
        a node without a rank, or one whose end is already counted, or a round already decided, changes nothing.
        """
        if not round_.formed:
            if node in round_.nodes:
                round_.nodes.remove(node)
            return False
        return node.rank is not None and round_.decision is None and node.rank not in round_.done

    def _gone(self, round_: _Round, node: _Node, why: str) -> None:
        with self._lock:
            if not self._still_running(round_, node):
                return
        # A lost node is final: the others cannot form the cluster again without it.
        self._finished(round_, node.rank, TaskFailure(f"node {node.rank} ({node.host})", None, ended=f"lost: {why}"),
                       final=True)

    def _finished(self, round_: _Round, rank: int, failure: TaskFailure | None, final: bool) -> None:
        with self._lock:
            if round_.decision is not None or rank in round_.done:
                return
            round_.done.add(rank)
            round_.final = round_.final or final
            if failure is None:
                if len(round_.done) == len(round_.nodes) and not round_.failures:
                    self._decide(round_)
                elif rank == 0 and not round_.failures:  # worker 0 finished: the rest get --exit-grace
                    threading.Timer(self.exit_grace, self._settle, args=(round_,)).start()
                return
            round_.failures.append((len(round_.failures), failure))
            first = len(round_.failures) == 1
        if first:
            threading.Timer(SETTLE, self._settle, args=(round_,)).start()

    def _settle(self, round_: _Round) -> None:
        with self._lock:
            self._decide(round_)

    def _decide(self, round_: _Round) -> None:
        """Called with the lock held: the decision, once, to every node of the round."""
        if round_.decision is not None:
            return
        failure = min(round_.failures, key=_rank)[1] if round_.failures else None
        preempted = failure is not None and is_preempted(failure.returncode)
        # (with p preemptions before it, round n has had n - p failure restarts)
        restart = failure is not None and not round_.final and (
            preempted or round_.number - self.preemptions + 1 < self.attempts)
        self.preemptions += preempted and restart
        round_.decision = {"failure": None if failure is None else failure_to_json(failure), "restart": restart}
        end = message("END", round_.decision)
        for node in round_.nodes:
            node.send(end)

    def _heartbeats(self) -> None:
        while not self._closing.wait(HEARTBEAT):
            with self._lock:
                nodes = [n for r in self._rounds.values() if r.decision is None for n in r.nodes]
            for node in nodes:
                node.send(b"HB\n")

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            nodes = [n for r in self._rounds.values() for n in r.nodes]
        for node in nodes:
            listener.shut(node.conn)
