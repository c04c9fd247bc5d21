"""A trial bigger than one worker: a group of K MultiWorkerMirrored workers that is one tuner of a search.

`stratkit launch --tune --workers 4 --workers-per-trial 2` makes two groups;
each has a TF_CONFIG of its own (a cluster of its K workers, planned by
`stratkit.cluster.layout` as any launch's) and is one tuner of the search
(KerasTuner's one tuner id per group): the group trains each of its trials
together under MultiWorkerMirroredStrategy, with the trial's batch as the
global batch, so a group's trial equals the same trial in one process.

Only the group's chief (its worker 0) talks to the search service. The other
workers follow it in lockstep, through the group's own channel: TensorFlow's
coordination service key-value store, which every MultiWorkerMirrored worker
already runs (`stratkit.strategy.keras_compat.coordination`):

* the chief publishes its registration's answer (the search's seed), and its
  connection is wrapped (`LeaderChannel`): every answer the followers' code
  will ask for too - each `next` (a trial, or the end with the results), each
  `query` and `files` (Hyperband's parent trial's files) - is published under
  a key numbered in the order they are asked, which is the same on every
  worker of the group (they run the same search code on the same trials);
* a follower's channel (`FollowerChannel`) reads those keys instead of
  asking the service, and answers the rest itself: it sends no heartbeat,
  report or result, and writes nothing to the store (its client, its
  files, its tracker are the chief's).

A lease the service takes back from a group is not stopped mid-trial (the
chief alone stopping would leave the others in a collective): the group
finishes the trial, and the service refuses its result (another tuner ran
it). A group member that dies ends its group: the chief's store answers no
more (the others fail at once) or a follower's collective breaks; the
launcher stops the group, and its lease expires.

Imports TensorFlow through the coordination store only when a group runs.
"""

from __future__ import annotations

import json
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError

log = status.logger(__name__)

#: Key prefix of a search's messages in the group's store (then the search's number in the run).
PREFIX = "stratkit/tune"
#: Seconds between a follower's checks while it waits for the chief (the store's own get blocks in between).
POLL = 5.0
#: Answers a follower gives itself: it neither renews, nor reports, nor ends a trial (the chief does).
_OWN = {"beat": {"alive": True}, "built": {}, "report": {"alive": True, "reply": {}}, "end": {"accepted": True},
        "abort": {}, "bye": {}}
_PUBLISHED = ("next", "query", "files")

def store_of(strategy: Any) -> Any:
    """The group's channel: its MultiWorkerMirrored strategy's key-value store.

    Raises:
        ConfigError: the strategy is not a multi-worker one with TensorFlow's coordination service.
    """
    from stratkit.strategy.keras_compat import coordination

    store = coordination.store_for(strategy)
    if store is None:
        raise ConfigError("a multi-worker trial's workers follow their chief through TensorFlow's coordination "
                          "service, which this TensorFlow does not offer (or the tuner has no MultiWorkerMirrored "
                          "strategy). Fix: run one trial per worker (drop --workers-per-trial), or a TensorFlow "
                          "release stratkit supports")
    return store


class LeaderChannel:
    """The group chief's connection to the service, publishing what its followers will ask for."""

    def __init__(self, inner: Any, store: Any, search: int) -> None:
        self.inner = inner
        self.store = store
        self.prefix = f"{PREFIX}/{search}"
        self.counts: dict[str, int] = {}

    def request(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        reply = self.inner.request(op, fallback, **fields)
        ok = reply.get("ok") if isinstance(reply.get("ok"), dict) else None
        if op in _PUBLISHED and not (op == "next" and ok is not None and ok.get("wait")):
            number = self.counts[op] = self.counts.get(op, 0) + 1
            self.store.insert(f"{self.prefix}/{op}/{number}", json.dumps(reply))
        return reply

    def close(self) -> None:
        self.inner.close()


class FollowerChannel:
    """A follower's channel: the chief's published answers, and its own for what only the chief does."""

    def __init__(self, store: Any, search: int, label: str) -> None:
        self.store = store
        self.prefix = f"{PREFIX}/{search}"
        self.label = label
        self.counts: dict[str, int] = {}

    def _read(self, key: str) -> dict[str, Any]:
        while True:
            value = self.store.get(f"{self.prefix}/{key}", timeout=POLL)
            if value is not None:
                return json.loads(value)

    def request(self, op: str, fallback: Any = None, **fields: Any) -> dict[str, Any]:
        if op == "register":
            return self._read("config")
        if op in _PUBLISHED:
            number = self.counts[op] = self.counts.get(op, 0) + 1
            return self._read(f"{op}/{number}")
        return {"ok": dict(_OWN.get(op, {}))}

    def close(self) -> None:
        pass


__all__ = ["FollowerChannel", "LeaderChannel", "PREFIX", "store_of"]
