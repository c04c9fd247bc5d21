"""The elastic rendezvous of `stratkit launch --nnodes MIN:MAX`: who is in each round, and when it changes.

The same server as `--nnodes N` (`stratkit.launch.rendezvous.RendezvousServer`:
authentication, wire format, heartbeats, the failure decision), with a
membership that may change between rounds. A round is one start of the
cluster; the rendezvous, not the node, chooses which round a node joins.

When a round forms (`ElasticRendezvous._check_open`, every `TICK` s):
    * never without the serving node (node 0: it serves, and its worker 0 is the chief);
    * at once when MAX nodes joined;
    * else when MIN nodes joined, every node that survived the previous round
      rejoined (or `rejoin_grace` s passed: the survivors stop their tasks first,
      up to --stop-grace), and `last_call` s (--rdzv-last-call) passed since the
      change that ended the previous round (the first round: since MIN joined);
    * below MIN once `rejoin_grace` + `last_call` s passed after a change: every
      waiting node gets END with a failure naming the missing nodes (exit 1).

While a round runs:
    * a node lost (its connection closed: at once; silent: `LOST_AFTER` s) ends
      the round as a *membership change*: every survivor stops its tasks and
      joins the next round, which resumes from backup_dir. A task failure
      reported while some node is silent waits for that node (lost, or heard
      from again) before it is weighed, so a failure caused by a lost host is
      not counted as a failure. A node not back within the next round's last
      call is lost for good: the world shrinks (or ends below MIN).
    * a node whose launcher was preempted (SIGTERM or --preemption-signal:
      its tasks, and with them every worker, saved at one step and exited 75)
      reports so and leaves: a membership change like a loss, and the next
      round resumes at that step.
    * a node arriving with another GPU count than the running nodes is refused
      (they go on); else a node arriving (fewer than MAX running) ends the
      round as a membership change after `SETTLE` s; it is in the next round.
      Every node stops its tasks with SIGTERM, their preemption notice: they
      save at the next step boundary and exit 75, and the next round resumes
      there (nothing is trained again; at most backup_every steps when a save
      does not finish within --stop-grace). With MAX running it is refused;
      once worker 0 finished training it is refused too.
    * a task failure is decided as with `--nnodes N`; it restarts the cluster
      while --max-restarts allows; a preemption (exit 75) restarts it without
      counting. Membership changes do not count against --max-restarts
      (torchrun counts both).

If the serving node itself is lost, the run cannot go on (the rendezvous is
gone): the other nodes end non-zero, as with torchrun's c10d backend.

Imports no TensorFlow.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stratkit.launch.rendezvous import (
    HEARTBEAT,
    SETTLE,
    RendezvousServer,
    _Node,
    _rank,
    _Round,
    failure_to_json,
    message,
)
from stratkit import timeline
from stratkit.process.report import TaskFailure, is_preempted

#: How often the open round is checked (last call, rejoin grace, below MIN).
TICK = 0.2
#: A node silent for longer than this is not trusted to be alive when a failure is weighed.
STALE = 2.5 * HEARTBEAT
#: HELLO numbers the elastic rendezvous accepts: each node counts its own starts; the server picks the round.
_ANY_ATTEMPT = 10**6


def who(node: _Node) -> str:
    """`h2 (198.18.0.2)`: the node's hostname and address (the same in every round)."""
    return f"{node.label} ({node.host})" if node.host else node.label


def key(node: _Node) -> str:
    """The node's identity across rounds: its launcher's id (two launchers on one host differ)."""
    return node.uid or who(node)


@dataclass(frozen=True)
class Change:
    """One membership change: `kind` "lost" or "arrived", the node, and why (lost).

    `saved`: a node that left after its tasks saved at one step (its launcher was preempted), not one that
    vanished: the others' tasks then reach that step boundary too, instead of waiting on a peer that is gone.
    """

    kind: str
    node: str  # who()
    key: str = ""  # key()
    rank: int | None = None
    why: str = ""
    saved: bool = False

    def __str__(self) -> str:
        rank = "" if self.rank is None else f"{self.rank} "
        return f"node {rank}{self.node} {self.kind}" + (f" ({self.why})" if self.why else "")


@dataclass
class _Membership:
    """What the elastic rendezvous knows of one round beyond `_Round`."""

    opened: float = field(default_factory=time.monotonic)
    survivors: list[str] = field(default_factory=list)  # who() of the previous round's nodes expected back
    previous: int = 0  # the previous round's number of nodes (0: this is the first round)
    changes: list[Change] = field(default_factory=list)  # why the previous round ended
    enough_since: float | None = None  # when MIN nodes (and every survivor) were first in
    during: list[Change] = field(default_factory=list)  # changes while this round ran
    chief_done: bool = False  # node 0's tasks finished (training is over)
    restart: str = "a failure restart"  # why the previous round restarted, when no membership changed


class ElasticRendezvous(RendezvousServer):
    """Node 0's rendezvous for `--nnodes MIN:MAX` (see the module docstring)."""

    def __init__(self, host: str, port: int, token: bytes, min_nodes: int, max_nodes: int, workers_per_node: int,
                 *, max_restarts: int = 0, last_call: float = 3.0, rejoin_grace: float = 20.0,
                 exit_grace: float = 30.0, gpus: int | None = None) -> None:
        self.min_nodes, self.max_restarts = min_nodes, max_restarts
        self.last_call, self.rejoin_grace = last_call, rejoin_grace
        self.failure_restarts = 0
        self._open = 0  # the round new nodes join
        self._running: int | None = None  # the round that trains now
        self._members: dict[int, _Membership] = {0: _Membership()}
        super().__init__(host, port, token, max_nodes, workers_per_node, attempts=_ANY_ATTEMPT,
                         exit_grace=exit_grace, gpus=gpus)
        threading.Thread(target=self._ticks, name="stratkit-rdzv-elastic", daemon=True).start()

    def members(self, number: int) -> _Membership:
        with self._lock:
            return self._member(number)

    def _member(self, number: int) -> _Membership:
        return self._members.setdefault(number, _Membership())

    # -- joining ----------------------------------------------------------------------------------
    def _join(self, round_: _Round, node: _Node, data: Any) -> bool:
        if isinstance(data, dict):
            node.uid = str(data.get("id") or "")[:64]
        return super()._join(round_, node, data)

    def _round_for(self, attempt: int) -> _Round:
        return self.round(self._open)

    def _joined(self, round_: _Round, node: _Node) -> None:
        running = None
        with self._lock:
            if self._running is not None and round_.number == self._open:
                running = self._rounds[self._running]
                info = self._member(running.number)
                counts = {n.gpus for n in running.nodes if n.gpus is not None}
                if info.chief_done:
                    refuse = "training is finishing (node 0's tasks are done)"
                elif node.gpus is not None and counts and node.gpus not in counts:
                    # the running nodes are not stopped for a node that could never join them
                    refuse = (f"this node shows {node.gpus} GPU(s) but the running nodes show {min(counts)}: a "
                              "cluster of different GPU counts cannot train (set CUDA_VISIBLE_DEVICES to match)")
                elif len(running.nodes) - sum(c.kind == "lost" for c in info.during) >= self.nnodes:
                    refuse = f"the cluster already runs --nnodes MAX={self.nnodes} nodes"
                else:
                    refuse = ""
                    info.during.append(Change("arrived", who(node), key=key(node)))
                if refuse:
                    round_.nodes.remove(node)
                    node.send(f"REFUSED {refuse}\n".encode())
                    return
        if running is not None:  # admitted: the running round ends now; every node starts again, larger
            timeline.mark("rdzv: node arrived")
            threading.Timer(SETTLE, self._settle, args=(running,)).start()
        self._check_open()

    def _ticks(self) -> None:
        while not self._closing.wait(TICK):
            self._check_open()

    def _check_open(self) -> None:
        """Form the open round, or end it below MIN, when the rules of the module docstring say so."""
        with self._lock:
            round_ = self._rounds.get(self._open)
            if self._running is not None or round_ is None or round_.formed or round_.decision is not None:
                return
            info = self._member(round_.number)
            now = time.monotonic()
            joined = len(round_.nodes)
            back = not (Counter(info.survivors) - Counter(key(n) for n in round_.nodes))
            back = back or now >= info.opened + self.rejoin_grace
            serving = any(n.serving for n in round_.nodes)
            form = False
            if serving and joined >= self.nnodes:
                form = True
            elif serving and joined >= self.min_nodes and back:
                info.enough_since = info.enough_since or now
                # After a change, the last call runs from the change, while the survivors stop their tasks and
                # rejoin (it still gives a replacement that long to join); at the start, from MIN nodes in.
                form = now >= (info.opened if info.previous else info.enough_since) + self.last_call
            else:
                info.enough_since = None
                if info.previous and now >= info.opened + self.rejoin_grace + self.last_call:
                    self._below_min(round_, info)
                    return
            if form:  # claimed under the lock: one thread forms it
                self._running, self._open = round_.number, round_.number + 1
                self._member(self._open)
        if form:
            self._form(round_)

    def _cluster_extra(self, round_: _Round) -> dict[str, Any]:
        info = self._member(round_.number)
        change = None
        if info.previous:
            back = self._returned(round_, info)
            why = [f"{c} and back" if c in back else str(c) for c in info.changes]
            change = (f"world size {info.previous * self.workers_per_node} -> "
                      f"{len(round_.nodes) * self.workers_per_node}: {'; '.join(why) or info.restart}")
        return {"change": change, "min": self.min_nodes, "max": self.nnodes}

    def _returned(self, round_: _Round, info: _Membership) -> list[Change]:
        """The lost nodes of `info.changes` back in `round_`: a new launcher on the same host and address."""
        newcomers = [who(n) for n in round_.nodes if key(n) not in info.survivors]
        return [c for c in info.changes if c.kind == "lost" and c.node in newcomers]

    def _below_min(self, round_: _Round, info: _Membership) -> None:
        """Called with the lock held: fewer than MIN nodes came back; every waiting node ends with the reason."""
        here = [who(n) for n in round_.nodes]
        back = self._returned(round_, info)
        missing = [str(c) for c in info.changes if c.kind == "lost" and c not in back]
        previous = self._rounds[round_.number - 1].nodes if round_.number else []
        names = {key(n): f"node {n.rank} {who(n)}" for n in previous}
        keys = [key(n) for n in round_.nodes]
        missing += [f"{names.get(s, s)} (did not rejoin)" for s in (Counter(info.survivors) - Counter(keys))]
        failure = TaskFailure("the rendezvous", None, ended=(
            f"ended below --nnodes MIN={self.min_nodes}: {len(here)} node(s) here ({', '.join(here) or 'none'}) "
            f"after waiting {self.rejoin_grace + self.last_call:g} s; missing: {'; '.join(missing) or 'unknown'}. "
            f"Fix: start stratkit launch on the missing nodes again, or allow fewer nodes with --nnodes "
            f"<MIN>:{self.nnodes}"))
        round_.decision = {"failure": failure_to_json(failure), "restart": False, "resize": None}
        end = message("END", round_.decision)
        for node in round_.nodes:
            node.send(end)

    # -- while a round runs -----------------------------------------------------------------------
    def _gone(self, round_: _Round, node: _Node, why: str) -> None:
        with self._lock:
            if not self._still_running(round_, node):
                return
            round_.done.add(node.rank)
            info = self._member(round_.number)
            info.during.append(Change("lost", who(node), key(node), node.rank, why))
            first = sum(c.kind == "lost" for c in info.during) == 1
        timeline.mark("rdzv: node lost")
        if first:  # other losses within SETTLE s are the same change
            threading.Timer(SETTLE, self._settle, args=(round_,)).start()

    def _finished(self, round_: _Round, rank: int, failure: TaskFailure | None, final: bool) -> None:
        if rank == 0 and failure is None:
            with self._lock:
                self._member(round_.number).chief_done = True
        if rank != 0 and final and failure is not None and is_preempted(failure.returncode):
            # A node whose launcher was preempted leaves, after every task saved at one step: the others go on
            # without it from that step (node 0 cannot leave: the rendezvous goes with it).
            with self._lock:
                node = next((n for n in round_.nodes if n.rank == rank), None)
                if node is not None and self._still_running(round_, node):
                    self._member(round_.number).during.append(Change("lost", who(node), key(node), rank,
                                                                     failure.reason, saved=True))
        super()._finished(round_, rank, failure, final)

    def _settle(self, round_: _Round) -> None:
        with self._lock:
            info = self._member(round_.number)
            if round_.failures and not info.during and round_.decision is None:
                # A failure while a node is silent may be that node's loss: wait until it is heard or lost.
                now = time.monotonic()
                if any(n.rank not in round_.done and now - n.last_seen > STALE for n in round_.nodes):
                    threading.Timer(TICK, self._settle, args=(round_,)).start()
                    return
            self._decide(round_)

    def _decide(self, round_: _Round) -> None:
        """Called with the lock held: a membership change, or the failure decision (restart while allowed)."""
        if round_.decision is not None:
            return
        info = self._member(round_.number)
        if info.during and not info.chief_done:
            # "vanished": a peer of the running tasks is gone without a save; they cannot reach a step boundary
            vanished = any(c.kind == "lost" and not c.saved for c in info.during)
            round_.decision = {"failure": None, "restart": True, "resize": "; ".join(map(str, info.during)),
                               "vanished": vanished}
        else:
            failure = min(round_.failures, key=_rank)[1] if round_.failures else None
            preempted = failure is not None and is_preempted(failure.returncode)  # (not counted)
            restart = failure is not None and not round_.final and (preempted or
                                                                   self.failure_restarts < self.max_restarts)
            self.failure_restarts += restart and not preempted
            round_.decision = {"failure": None if failure is None else failure_to_json(failure), "restart": restart,
                               "resize": None}
        end = message("END", round_.decision)
        for node in round_.nodes:
            node.send(end)
        if self._running == round_.number:
            self._running = None
        if round_.decision["restart"]:
            lost = Counter(c.key for c in info.during if c.kind == "lost")
            nxt = self._member(self._open)
            nxt.opened, nxt.previous, nxt.changes = time.monotonic(), len(round_.nodes), list(info.during)
            if round_.decision["failure"] is not None and is_preempted(round_.decision["failure"].get("returncode")):
                nxt.restart = "a restart after a preemption (every task saved at one step; not counted)"
            nxt.survivors = list((Counter(key(n) for n in round_.nodes) - lost).elements())

