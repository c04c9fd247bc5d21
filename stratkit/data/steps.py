"""A worker's steps: its ordered rows cut at the global batch boundaries, a chunk of steps at a time, each step
split over the worker's replicas.

How many of a worker's rows each global batch holds is a closed form of the lanes (`batch_counts`, the
vectorised `shards.Layout.offsets`); the rows come in global order from the read-ahead (`readahead`), so a step
is the next that many rows. A chunk carries several steps' rows in one set of arrays and the offsets where each
replica's part starts: the Python hand-off to tf.data costs per chunk, and the graph cuts the steps from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from stratkit.data.batching import Batcher
from stratkit.data.shards import Layout, steps_for


@dataclass
class Chunk:
    """Consecutive steps of this worker: the arrays of their rows, in order, and where each replica's part of
    each step starts and ends (`splits`: steps x replicas + 1 offsets)."""

    arrays: list[Any]
    splits: np.ndarray

    def parts(self, feed: Batcher) -> Iterator[tuple]:
        for a, b in zip(self.splits[:-1], self.splits[1:]):
            yield feed.pack([array[a:b] for array in self.arrays])

    def stacked(self, feed: Batcher) -> Iterator[tuple]:
        """The parts in order, each run of consecutive parts of one size as one packed batch with a leading axis
        of the run's length (`tf.data`'s `unbatch` cuts them into the parts in C++: no Python, no graph function
        per step). Every part of a chunk has the same size but those of a worker's uneven steps and the last."""
        sizes = np.diff(self.splits)
        if not len(sizes):
            return
        ends = np.flatnonzero(np.diff(sizes)) + 1
        for first, stop in zip(np.concatenate([[0], ends]), np.concatenate([ends, [len(sizes)]])):
            at, size, count = int(self.splits[first]), int(sizes[first]), int(stop - first)
            yield feed.pack([array[at:at + size * count].reshape((count, size, *array.shape[1:]))
                             for array in self.arrays])


class Splitter:
    """Cuts the ordered rows at this worker's batch boundaries, a chunk of `per_chunk` steps at a time, each
    step's rows split over its replicas (contiguous parts, sizes differing by at most one)."""

    def __init__(self, counts: np.ndarray, replicas: int, feed: Batcher, per_chunk: int = 1) -> None:
        self.counts = np.asarray(counts, np.int64)
        self.replicas = max(int(replicas), 1)
        self.feed = feed
        self.per_chunk = max(int(per_chunk), 1)
        self.step = 0
        self.parts: list[list[Any]] = []
        self.have = 0

    def add(self, arrays: list[Any], rows: int) -> Iterator[Chunk]:
        if rows:
            self.parts.append(arrays)
            self.have += rows
        while self.step < len(self.counts):
            steps = min(self.per_chunk, len(self.counts) - self.step)
            if self.have < int(self.counts[self.step:self.step + steps].sum()):
                return
            yield self._emit(steps)

    def finish(self) -> Iterator[Chunk]:
        while self.step < len(self.counts):   # only empty batches can be left (a worker without lanes)
            yield self._emit(min(self.per_chunk, len(self.counts) - self.step))

    def _emit(self, steps: int) -> Chunk:
        counts = self.counts[self.step:self.step + steps]
        self.step += steps
        rows = int(counts.sum())
        arrays = self._take(min(rows, self.have))
        shares = np.floor(np.outer(counts, np.arange(1, self.replicas + 1)) / self.replicas + 0.5).astype(np.int64)
        ends = shares + np.concatenate([[0], np.cumsum(counts)[:-1]])[:, None]
        return Chunk(arrays, np.concatenate([[0], ends.reshape(-1)]).astype(np.int64))

    def _take(self, rows: int) -> list[Any]:
        taken: list[list[Any]] = []
        need = rows
        while need and self.parts:
            head = self.parts[0]
            n = len(head[0])
            if n <= need:
                taken.append(head)
                self.parts.pop(0)
                need -= n
            else:
                taken.append([a[:need] for a in head])
                self.parts[0] = [a[need:] for a in head]
                need = 0
        self.have -= rows - need
        if not taken:
            return self.feed.empty()
        if len(taken) == 1:
            return taken[0]
        return [np.concatenate(column) for column in zip(*taken)]


def has_empty_parts(layout: Layout, batch: int, world: int, rank: int, replicas: int) -> bool:
    """Whether a replica of worker `rank` gets no rows in some step (a step of fewer rows of this worker than it has
    replicas: a worker owning no lanes, the last small batch); the same every pass."""
    first, stop = layout.owned(world, rank)
    counts = batch_counts(layout, batch, first, stop, steps_for(layout.rows, batch))
    return bool(len(counts)) and int(counts.min()) < max(int(replicas), 1)


def batch_counts(layout: Layout, batch: int, first: int, stop: int, steps: int) -> np.ndarray:
    """Rows of lanes [first, stop) in each global batch of a pass (vectorised `Layout.offsets`)."""
    edges = np.minimum(np.arange(steps + 1, dtype=np.int64) * batch, layout.rows)
    q, lanes = layout.rounds, layout.lanes
    full = q * lanes
    pos = np.sort(layout.visit_pos[first:stop])
    ranks = layout.long_rank[first:stop]
    longs = np.sort(ranks[ranks >= 0])
    n = stop - first
    early = edges <= full
    r, rem = np.divmod(np.minimum(edges, full), lanes)
    before = np.where(early, n * r + np.searchsorted(pos, rem, side="left"),
                      n * q + np.searchsorted(longs, edges - full, side="left"))
    return np.diff(before)


__all__ = ["Chunk", "Splitter", "batch_counts"]
