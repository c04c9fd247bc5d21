"""One worker's reader: its lanes fetched and decoded by background threads within a byte budget, turned into
the per-replica batches of each global step.

A worker reads block after block (`shards.Layout.block`: window j of each of its lanes). Decode threads fetch
each lane's window (a lane reader keeps its place in the stream between windows, so a row group is opened
once per lane that reads it); a block is put together when every lane's window is in: the rows taken in global
order (the feed's arrays, `batching.Batcher.arrays` through `columns.py`, gathered by numpy), cut
at the global batch boundaries (this worker's rows of batch k: `shards.Layout` in closed form) and each
batch split into its replicas' parts, a chunk of steps at a time. The step only takes finished chunks from a
queue; tf.data cuts each into its steps (`unbatch` of its runs of equal parts: one Python hand-off per run, not
per step). A block's order (`shards.Layout.block`, numpy sorts without the GIL) is worked out in the pool beside
its windows' decode, and the blocks run on across passes: the next pass's first blocks are read while this
pass's last ones are put together, so an epoch boundary of `fit` does not wait for a whole block.

Memory: what the read-ahead budget holds, and so how many blocks are read ahead, is `stratkit.data.budget`'s
(`memory_plan`, `check_budget`; the names stay importable from here).

A failure in a thread (a file that vanished, a store that refuses) is raised by the iterator, once, as a
`TableReadError` naming the file; the threads stop.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from stratkit.data import sources
from stratkit.data.cursor import Cursor
from stratkit.data.batching import Batcher
from stratkit.data.budget import (
    DECODE_BATCH_BYTES,
    DECODE_ROWS_BOUNDS,
    MAX_AHEAD_BLOCKS,
    block_bytes,
    check_budget,
    decode_rows,
    lane_bytes,
    layout_rows_per_block,
    memory_plan,
)
from stratkit.data.plan import Plan, Stream
from stratkit.data.shards import Layout, steps_for
from stratkit.data.steps import Chunk, Splitter, batch_counts
from stratkit.errors import ConfigError

#: Finished chunks kept ready for the training step.
READY_CHUNKS = 2
#: A chunk holds about this many of a worker's rows (whole steps, at most `MAX_CHUNK_STEPS`, at most a block's): the
#: Python hand-off to tf.data costs per chunk, the steps are cut from it by tf.data (`Chunk.stacked`, `unbatch`).
#: 1M rows of 16 float32s into `Dataset.reduce`, pre-made chunks: 5.3M rows/s at 8,192 rows, 7.1M at 65,536.
CHUNK_ROWS = 32768
MAX_CHUNK_STEPS = 64
#: The newest failure a reader of this process raised (`last_failure`).
_FAILURES: list[BaseException] = []


#: Seconds `WorkerReader.close` waits for its threads (a window being decoded finishes first).
CLOSE_SECONDS = 30.0
#: The readers still running: closed at interpreter exit (`_close_all`).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for reader in list(_LIVE):
        reader.close()


def last_failure() -> BaseException | None:
    """The newest failure a reader in this process raised, for `Trainer.fit` to raise instead of the error
    TensorFlow's input pipeline wrapped it in (None: none)."""
    return _FAILURES[-1] if _FAILURES else None


class TableReadError(RuntimeError):
    """The table could not be read mid-run (a file vanished or was rewritten, the store refused)."""


@dataclass(frozen=True)
class ReaderSpec:
    """What one worker's reader needs (small and picklable)."""

    plan: Plan
    layout: Layout
    seed: int
    shuffle: bool
    world: int
    rank: int
    batch: int
    replicas: int
    start: Cursor
    passes: int | None          # None: endless
    budget: int
    threads: int


class LaneReader:
    """One lane of one pass: its stream rows from `first` to `stop`, read in order, a window at a time."""

    def __init__(self, plan: Plan, stream: Stream, first: int, stop: int, names: list[str], batch_rows: int,
                 fs: Any, cache: dict[int, Any], block: int = 0) -> None:
        self.batches = self._batches(plan, stream.pieces(first, stop), names, batch_rows, fs, cache)
        self.left: Any = None
        self.next = block                       # the window this lane reads next
        self.turn = threading.Condition()

    @staticmethod
    def _batches(plan: Plan, pieces: list, names: list[str], batch_rows: int, fs: Any,
                 cache: dict[int, Any]) -> Iterator[Any]:
        for piece in pieces:
            try:
                yield from sources.read_piece(plan, piece, names, batch_rows, fs, cache)
            except ConfigError:          # the data itself is refused (a null), naming the file and the fix
                raise
            except Exception as exc:  # noqa: BLE001 - said once with the file named
                raise _read_error(plan, piece.unit, exc) from exc

    def read(self, rows: int) -> list[Any]:
        """The next `rows` rows, as RecordBatches."""
        out, have = [], 0
        while have < rows:
            batch = self.left if self.left is not None else next(self.batches)
            self.left = None
            need = rows - have
            if batch.num_rows > need:
                self.left = batch.slice(need)
                batch = batch.slice(0, need)
            out.append(batch)
            have += batch.num_rows
        return out


def _read_error(plan: Plan, unit: int, exc: BaseException) -> TableReadError:
    path = plan.files[int(plan.unit_file[unit])]
    if isinstance(exc, FileNotFoundError):
        what = "is gone (deleted or moved after the run planned the table at its start)"
        fix = ("restore the file and resume from the last backup; for a Delta table, keep the versions a run reads "
               "(VACUUM removes the files of old versions)")
    else:
        what = f"could not be read ({type(exc).__name__}: {exc})"
        fix = "check the store and the file, then resume from the last backup"
    return TableReadError(f"table file {path!r} {what}. Training stopped; the backups written so far are kept. "
                          f"Fix: {fix}")


class WorkerReader:
    """This worker's per-replica batches, step after step (an iterator; `close()` stops its threads)."""

    def __init__(self, spec: ReaderSpec, feed: Batcher) -> None:
        from stratkit.storage.arrow import arrow_filesystem

        self.spec = spec
        self.feed = feed
        self.names = feed.read_columns
        self.first_lane, self.stop_lane = spec.layout.owned(spec.world, spec.rank)
        self.steps = steps_for(spec.plan.rows, spec.batch)
        check_budget(spec.layout, spec.plan, spec.world, spec.budget)
        self.ahead, self.block_bytes, _ = memory_plan(spec.layout, spec.plan, self.first_lane, self.stop_lane,
                                                      spec.budget)
        self.fs = arrow_filesystem(spec.plan.root, "table path")[0]
        self.cache: dict[int, Any] = {}
        self.pool = ThreadPoolExecutor(max(1, spec.threads), thread_name_prefix="stratkit-table-read")
        share = max(1, spec.batch // max(spec.world, 1))
        fits = int(spec.budget // (8 * share * max(spec.plan.row_bytes, 1.0)))   # 2 ready chunks: a quarter
        block_rows = layout_rows_per_block(spec.layout, self.first_lane, self.stop_lane)
        # no more than a block's rows either: a chunk spanning blocks would hold the first step back
        self.per_chunk = max(1, min(MAX_CHUNK_STEPS, -(-min(CHUNK_ROWS, max(block_rows, 1)) // share), fits))
        self.ready: queue.Queue = queue.Queue(READY_CHUNKS)
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="stratkit-table-assemble", daemon=True)
        _LIVE.add(self)
        self.thread.start()

    # -- the consumer's side ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[tuple]]:
        """Step after step: each a list of `replicas` per-replica `(x, y[, sample_weight])` tuples."""
        for chunk in self.chunks():
            parts = list(chunk.parts(self.feed))
            for at in range(0, len(parts), self.spec.replicas):
                yield parts[at:at + self.spec.replicas]

    def chunks(self) -> Iterator[Chunk]:
        """The steps as they come from the assembler, `per_chunk` at a time (what the tf.data pipeline takes)."""
        while True:
            item = self.ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                self.failure = item
                _FAILURES[:] = [item]
                self.close()
                raise item
            yield item

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the threads and wait for them (within `timeout`): a thread left inside pyarrow when the
        interpreter exits aborts the process ("terminate called without an active exception", measured)."""
        self.stopping.set()
        try:
            while True:
                self.ready.get_nowait()
        except queue.Empty:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        closer = threading.Thread(target=self.pool.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                  name="stratkit-table-close", daemon=True)
        closer.start()
        closer.join(timeout)
        _LIVE.discard(self)

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    # -- the assembler thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._assemble()
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(exc if isinstance(exc, (TableReadError, ConfigError)) else
                      TableReadError(f"reading the table failed: {type(exc).__name__}: {exc}"))

    def _assemble(self) -> None:
        """Blocks in order, pass after pass, at most `ahead` of them read ahead of the one being put together: the
        next pass's first blocks are read while this pass's last ones are assembled (at a pass boundary the step
        would otherwise wait for a whole block to be decoded: every epoch of `fit`)."""
        pending: collections.deque[_Job] = collections.deque()
        jobs = self._jobs()
        splitter: Splitter | None = None
        while not self.stopping.is_set():
            while sum(job.reads is not None for job in pending) <= self.ahead:
                job = next(jobs, None)
                if job is None:
                    break
                pending.append(job)
            if not pending:
                return
            job = pending.popleft()
            if job.reads is None:                   # the pass's end: its last steps (empty ones of a lane-less worker)
                for step in (splitter.finish() if splitter is not None else ()):
                    if not self._put(step):
                        return
                splitter = None
                continue
            if splitter is None:
                splitter = Splitter(job.pass_.counts, self.spec.replicas, self.feed, self.per_chunk)
            windows = [f.result() for f in job.reads]
            g, index = job.arranged.result()
            keep = g >= job.pass_.start
            if not keep.all():
                g, index = g[keep], index[keep]
            for step in splitter.add(_gathered(windows, index, self.spec.plan, self.names, self.feed), len(index)):
                if not self._put(step):
                    return
            del windows, job

    def _jobs(self) -> Iterator[_Job]:
        """Each pass's blocks from the cursor on, then its end; their reads submitted to the pool as taken."""
        spec, layout = self.spec, self.spec.layout
        a, b = self.first_lane, self.stop_lane
        cursor, done = spec.start, 0
        batch_rows = decode_rows(spec.plan, layout.window)
        total = layout.blocks()
        while spec.passes is None or done < spec.passes:
            start = cursor.global_position(spec.batch)
            pass_ = _Pass(start, batch_counts(layout, spec.batch, a, b, self.steps)[cursor.batch:])
            stream = spec.plan.stream(spec.seed, cursor.pass_, spec.shuffle)
            first_block = layout.first_block(start) if start < spec.plan.rows else total
            lanes = [LaneReader(spec.plan, stream, int(s), int(e), self.names, batch_rows, self.fs, self.cache,
                                first_block) for s, e in zip(layout.window_starts(first_block, a, b),
                                                             layout.starts[a + 1:b + 1])]
            for j in range(first_block, total):
                lengths = layout.window_lengths(j, a, b)
                reads = [self.pool.submit(_read_window, lane, j, int(n)) for lane, n in zip(lanes, lengths)]
                # the block's order too (numpy sorts without the GIL): off the assembler's path, beside the decode
                arranged = self.pool.submit(layout.block, j, a, b, spec.seed, cursor.pass_, spec.shuffle)
                yield _Job(pass_, reads, arranged)
            yield _Job(pass_, None, None)
            cursor = Cursor(cursor.pass_ + 1, 0)
            done += 1


@dataclass
class _Pass:
    """One pass as the assembler cuts it: where it starts (a global position) and this worker's rows per step."""

    start: int
    counts: np.ndarray


@dataclass
class _Job:
    """A block being read (its windows' and its order's futures), or a pass's end (`reads` None)."""

    pass_: _Pass
    reads: list[Future] | None
    arranged: Future | None


def _read_window(lane: LaneReader, block: int, rows: int) -> list[Any]:
    """Window `block` of `lane`, once the lane has read the windows before it (threads may take two windows of
    one lane at once; the pool's queue is FIFO, so the earliest one waiting is always running)."""
    with lane.turn:
        while lane.next != block:
            lane.turn.wait()
        try:
            return lane.read(rows) if rows else []
        finally:
            lane.next += 1
            lane.turn.notify_all()


def _gathered(windows: list[list[Any]], index: np.ndarray, plan: Plan, names: list[str], feed: Batcher) -> list[Any]:
    """The block's rows at `index`, in that order, as the feed's arrays (converted in stream order, then gathered
    by numpy: faster than Arrow's take on list columns)."""
    import pyarrow as pa

    if not len(index):
        return []
    batches = [b for window in windows for b in window]
    schema = pa.schema([plan.arrow_schema.field(n) for n in names])
    # np.take along axis 0: 4x numpy's fancy indexing on a (rows, 16) float32 array (233,052 rows: 4.2 ms, 18.6)
    return [np.take(array, index, axis=0) for array in feed.arrays(pa.Table.from_batches(batches, schema=schema))]


__all__ = ["CHUNK_ROWS", "Chunk", "DECODE_BATCH_BYTES", "DECODE_ROWS_BOUNDS", "LaneReader", "MAX_AHEAD_BLOCKS",
           "READY_CHUNKS", "ReaderSpec", "Splitter", "TableReadError", "WorkerReader", "batch_counts", "block_bytes",
           "check_budget", "decode_rows", "lane_bytes", "last_failure", "layout_rows_per_block", "memory_plan"]
