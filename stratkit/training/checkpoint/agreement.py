"""The step boundary every worker acts at: a preemption notice, or a backup the chief's clock made due.

A worker that sees a notice, or the chief whose clock says a timed backup is
due, must make every worker act at one and the same step boundary (each
writes its part of the backup there; a worker that stopped alone would leave
the others blocked in the next step's all-reduce). `for_fit` picks how:

* one process, a local Mirrored strategy: at once, at the boundary where it is
  seen (:class:`Agreement` without a collective);
* several MultiWorkerMirrored workers: **out of band**, through TensorFlow's
  coordination service key-value store (:class:`Rounds`), so that no step pays
  for it and a notice reaches every worker while they train, however long the
  steps are;
* several workers without a coordination service (or a caller's own
  `agree_flags`): a small collective every few boundaries (:class:`Agreement`).

Rounds, the protocol (learned from TensorFlow's `PreemptionCheckpointHandler`,
which sets the step to save at and waits until every worker's watcher thread
acknowledged it; here every worker names the boundary it has not crossed yet,
so the cluster can stop at the earliest boundary no worker has passed):

1. What needs agreement is a round: key `<fit>/<n>` holds `stop <rank>`,
   `backup <rank>` or `end <rank>`. Whoever posts takes the first free `n`
   (an insert of an existing key is refused). A notice is posted from a thread
   woken by the signal handler, even while the training thread is inside a
   step; at most one `stop` round per fit (a second notice finds the first).
2. Every worker's watcher thread reads the rounds in order (a blocking get).
   For `stop`/`backup` it takes, under the lock the training thread crosses
   boundaries with, the next boundary its training thread has not crossed,
   posts it (`<fit>/<n>/at/<rank>`) and reads everyone's: the round's
   boundary is the largest. Until that is known its training thread does not
   cross the boundary it posted; so no worker can pass the round's boundary
   unaware, and every worker acts there. `end <rank>` is a worker's `fit`
   ending: its own watcher stops; the others stop waiting for its answers.
3. The chief's clock posts a `backup` round at a boundary and waits for its
   answer there (a few ms, once per timed backup); `backup_every=K` steps and
   epoch backups need nothing (every worker counts alike).

Boundaries are counted per fit (every worker crosses as many: the same steps
run everywhere). Keys are namespaced per fit in this process (`stratkit/fit/<k>`;
every worker runs its fits in the same order, as their collectives require).
A peer that does not answer within :data:`REPLY_TIMEOUT` (it died: TensorFlow's
blocked get never returns then) is named in a warning; a notice then stops this
worker alone at its boundary, and a timed backup is skipped. A coordination
service that stops answering (its leader died) leaves a noticed worker to
stop alone at its next boundary.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from stratkit import status
from stratkit.strategy.keras_compat import coordination

log = status.logger(__name__)

#: How long a worker waits for every other worker's answer to a round (measured: 1.3 ms on loopback); a peer
#: silent for longer has died or hangs.
REPLY_TIMEOUT = 10.0
#: How long a training thread waits at a boundary for its watcher's decision (the watcher answers within
#: REPLY_TIMEOUT per round; a margin for a round queued behind another).
_DECISION_WAIT = 3 * REPLY_TIMEOUT
_FITS = itertools.count()


class Agreement:
    """The agreement by a collective: at a step boundary, did any worker see a notice, is the chief's backup due?

    `reduce(values) -> values` sums a few ints over the workers (one collective; every worker calls
    `decide` at every boundary); None on one process or a local Mirrored strategy, where every boundary
    decides at once. On several workers the collective has a fixed cost (measured: 11 ms per call on 2
    loaded CPU workers, where a small model's step took 45 ms; 4.2 ms of a 21 ms step unloaded), so it runs at
    every boundary only for the first :attr:`WARMUP` ones, which time it and the step; then every `interval`
    boundaries, the interval every worker takes from their proposals' mean (carried by the same collective, so
    all agree): the fewest boundaries that keep the collective under :attr:`BUDGET` of the training time, and
    no more than fit in :attr:`LATENCY` seconds (of the steps timed). Between two collectives nothing is decided:
    a notice is acted on at the next one (every worker stops at that same boundary), and what it stops there is
    saved, so no step is trained twice. Only where no coordination service runs (see :class:`Rounds`).
    """

    WARMUP = 8
    BUDGET = 0.02
    LATENCY = 0.5

    def __init__(self, reduce: Callable[[list[int]], list[int]] | None) -> None:
        self.reduce = reduce
        self.interval = 1
        self.boundaries = 0
        self._costs: list[float] = []
        self._gaps: list[float] = []
        self._last: float | None = None

    def start(self, notice: Any) -> None:
        """Nothing to start: notices are read at the boundaries."""

    def close(self) -> None:
        """Nothing to end."""

    def _proposal(self) -> int:
        """The interval this worker proposes from what it timed (0 while it is still timing)."""
        if len(self._gaps) < self.WARMUP - 1:
            return 0
        cost = sorted(self._costs)[len(self._costs) // 2]
        step = max(sorted(self._gaps)[len(self._gaps) // 2] - cost, 1e-6)      # training time per step
        wanted = int(cost / (self.BUDGET * step)) + 1
        return max(1, min(wanted, int(self.LATENCY / (step + cost))))

    def decide(self, noticed: bool, due: bool) -> tuple[bool, bool]:
        """At a step boundary: (stop here, back up here), alike on every worker."""
        if self.reduce is None:
            return noticed, due
        now = time.monotonic()
        if self._last is not None and self.interval == 1:
            self._gaps.append(now - self._last)
        self._last = now
        self.boundaries += 1
        if self.boundaries % self.interval:
            return False, False
        proposal = self._proposal() if self.interval == 1 else 0
        started = time.monotonic()
        agreed = self.reduce([int(noticed), int(due), proposal, int(proposal > 0)])
        self._costs.append(time.monotonic() - started)
        if agreed[3] and self.interval == 1:     # every worker proposed: take their mean, all alike
            self.interval = max(1, round(agreed[2] / agreed[3]))
            self.boundaries = 0
        return agreed[0] > 0, agreed[1] > 0


class Rounds:
    """The agreement through the coordination service's key-value store (the protocol: this module's docstring).

    Args:
        store: the key-value store (`stratkit.strategy.keras_compat.coordination.KeyValueStore` or one alike).
        rank: this worker's index among the `count` workers that train.
        count: how many workers train.
        namespace: the keys' prefix (default: the next fit of this process).
    """

    def __init__(self, store: Any, rank: int, count: int, namespace: str | None = None) -> None:
        self.store, self.rank, self.count = store, rank, count
        self.namespace = namespace or f"stratkit/fit/{next(_FITS)}"
        self._lock = threading.Condition()
        self._boundary = 0                          # the next boundary the training thread has not crossed
        self._answered: tuple[int, int] | None = None   # (round, boundary) this worker posted, until decided
        self._actions: dict[int, str] = {}          # boundary -> "stop" | "backup"
        self._decided: set[int] = set()             # rounds whose boundary is known
        self._read = 0                              # rounds the watcher has read
        self._stop_posted = False                   # a stop round exists (read by the watcher, or ours)
        self._broken: str | None = None             # why the channel no longer works
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # the notice (from the signal handler), or the end
        self._closing = False
        self._notice: Any = None
        self._threads: list[threading.Thread] = []

    # -- the fit's start and end --------------------------------------------------------------------
    def start(self, notice: Any) -> None:
        """Start the watcher and the thread that posts this worker's notice (woken by `notice`'s handler)."""
        self._notice = notice
        notice.listener = lambda: self._wake.put("notice")  # SimpleQueue.put: reentrant, safe in a signal handler
        for target, name in ((self._watch, "watcher"), (self._post_notice, "notice")):
            thread = threading.Thread(target=target, name=f"stratkit-{name}-{self.namespace}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if notice.noticed:
            self._wake.put("notice")

    def close(self) -> None:
        """End this worker's part: its watcher reads its own `end` round and stops (the threads end with `fit`)."""
        if self._closing or not self._threads:
            return
        self._closing = True
        if self._notice is not None:
            self._notice.listener = None
        self._wake.put("end")
        watcher, poster = self._threads
        if watcher.is_alive():
            try:
                self._post("end", quiet=True)
            except coordination.StoreError:
                pass  # the service is gone: so is the watcher's blocked read
        watcher.join(REPLY_TIMEOUT + 1.0)
        poster.join(1.0)

    # -- the training thread ----------------------------------------------------------------------
    def decide(self, noticed: bool, due: bool) -> tuple[bool, bool]:
        """At a step boundary: (stop here, back up here), alike on every worker.

        `noticed` is this worker's own notice (already posted by its thread: it matters only when the
        channel is broken); `due` the chief's clock (posts a `backup` round and waits for its boundary).
        """
        step = self._boundary
        if due and self._broken is None and not self._actions:  # (none ahead: a backup or stop is coming)
            posted = self._post("backup")
            if posted is not None:
                with self._lock:
                    self._wait(lambda: posted in self._decided or self._broken is not None)
        with self._lock:
            if self._answered is not None and self._answered[1] == step:
                self._wait(lambda: self._answered is None or self._answered[1] != step)
            action = self._actions.pop(step, None)
            self._boundary = step + 1
            if self._actions and min(self._actions) <= step:  # never: every worker waits at what it posted
                log.warning("step agreement: dropped actions for boundaries already crossed: %s", self._actions)
                self._actions = {b: a for b, a in self._actions.items() if b > step}
        if action is None and noticed and self._broken is not None:
            action = "stop"  # no channel left: this worker stops alone (its peers' next collective fails)
        return action == "stop", action == "backup"

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait (holding the lock) until `done()`, at most `_DECISION_WAIT` seconds."""
        deadline = time.monotonic() + _DECISION_WAIT
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._break(f"no decision within {_DECISION_WAIT:.0f} s")
                return
            self._lock.wait(left)

    # -- posting -----------------------------------------------------------------------------------
    def _key(self, number: int) -> str:
        return f"{self.namespace}/{number}"

    def _post(self, kind: str, quiet: bool = False) -> int | None:
        """Post a round of `kind` in the first free slot; its number (None: a stop round exists, or no channel).

        Raises:
            StoreError: only when `quiet` (else the channel is marked broken and None returned).
        """
        number = self._read
        try:
            while True:
                if kind == "stop" and self._stop_posted:
                    return None
                if self.store.insert(self._key(number), f"{kind} {self.rank}"):
                    return number
                if kind == "stop":
                    taken = self.store.get(self._key(number), REPLY_TIMEOUT) or ""
                    if taken.startswith("stop "):
                        return None  # another worker's notice is out already: one stop round per fit
                number += 1
        except coordination.StoreError as exc:
            if quiet:
                raise
            self._break(f"posting a {kind} round failed: {exc}")
            return None

    def _post_notice(self) -> None:
        self._wake.get()
        if not self._closing and self._broken is None and self._post("stop") is not None:
            self._stop_posted = True

    # -- the watcher ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        ended: set[int] = set()
        number = 0
        try:
            while True:
                kind, _, sender = self.store.get(self._key(number)).partition(" ")
                self._read = number + 1
                if kind == "end":
                    ended.add(int(sender))
                    if int(sender) == self.rank:
                        return
                else:
                    self._stop_posted = self._stop_posted or kind == "stop"
                    self._answer(number, kind, int(sender), ended)
                number += 1
        except coordination.StoreError as exc:
            if not self._closing:
                self._break(f"the coordination service stopped answering: {exc}")

    def _answer(self, number: int, kind: str, sender: int, ended: set[int]) -> None:
        """Post the boundary this worker has not crossed, read everyone's, and record the round's boundary."""
        with self._lock:
            mine = self._boundary
            self._answered = (number, mine)
        key = self._key(number)
        self.store.insert(f"{key}/at/{self.rank}", str(mine))
        boundary, missing = mine, []
        deadline = time.monotonic() + REPLY_TIMEOUT
        for peer in range(self.count):
            if peer == self.rank or peer in ended:
                continue
            value = self.store.get(f"{key}/at/{peer}", max(deadline - time.monotonic(), 0.001))
            if value is None:
                missing.append(peer)
            else:
                boundary = max(boundary, int(value))
        with self._lock:
            if missing:
                boundary = self._unanswered(kind, sender, missing, mine)
            if boundary is not None:
                action = "stop" if "stop" in (kind, self._actions.get(boundary)) else kind
                self._actions[boundary] = action
            self._answered = None
            self._decided.add(number)
            self._lock.notify_all()

    def _unanswered(self, kind: str, sender: int, missing: list[int], mine: int) -> int | None:
        names = ", ".join(f"worker {peer}" for peer in missing)
        what = "a preemption notice" if kind == "stop" else "a timed backup"
        if kind == "stop":
            log.warning("%s (from worker %d): %s did not answer within %g s (gone or hung): this worker stops "
                        "alone at its next step boundary", what, sender, names, REPLY_TIMEOUT)
            return mine
        log.warning("%s (from worker %d): %s did not answer within %g s (gone or hung): this backup is "
                    "skipped", what, sender, names, REPLY_TIMEOUT)
        return None

    def _break(self, why: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = why
                log.warning("preemption notices between workers: %s; a notice now stops only the worker that "
                            "gets it, at its next step boundary", why)
            self._answered = None
            self._lock.notify_all()


def for_fit(strategy: Any, agree_flags: Callable[[list[int]], list[int]] | None) -> Any:
    """How this fit's workers agree: `Rounds` on several workers with a coordination service, else `Agreement`.

    Args:
        strategy: the model's strategy.
        agree_flags: a caller's own SUM over the workers (`Backup`'s argument): `Agreement` with it.
    """
    if agree_flags is not None:
        return Agreement(agree_flags)
    store = coordination.store_for(strategy)
    if store is not None:
        rank, count = coordination.participants(strategy)
        return Rounds(store, rank, count)
    from stratkit.strategy import keras_compat

    if strategy is not None and keras_compat._is_multi_worker_collective(strategy):
        from stratkit.strategy import collectives

        return Agreement(lambda values: collectives.sum_over_workers(strategy, values))
    return Agreement(None)
