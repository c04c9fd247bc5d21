"""`stratkit.data.TableInput`: a table as training input, exactly once per epoch, in one order at any world size.

    data = stratkit.data.TableInput(stratkit.data.Table.parquet("s3://lake/events/"),
                                    features=["x"], label="y", seed=7)
    trainer.fit(model, data, epochs=3, global_batch_size=256, backup_dir="s3://runs/r1", backup_every=100)

`Trainer.fit` (and `validation_data=`, `Trainer.evaluate`) take it on every engine; a hand-written `model.fit`
under `make_strategy()` uses `dataset_fn` and `steps_per_epoch`. An engine that starts its own workers builds
each one's reader from (the planned table, world size, rank): `reader`.

The order, the lanes and the cursor: `docs/data.md`; `stratkit.data.shards`, `order`, `cursor`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from stratkit.data.cursor import Cursor, OrderRecord, check_resume
from stratkit.data.batching import Batcher
from stratkit.data.plan import Plan
from stratkit.data.budget import lane_bytes
from stratkit.data.readahead import ReaderSpec, WorkerReader
from stratkit.data.shards import Layout, steps_for
from stratkit.data.steps import has_empty_parts
from stratkit.data.table import Table
from stratkit.errors import ConfigError

#: The lane counts `lanes="auto"` picks from: each divisible by every world size up to 6 and by many more.
LANE_CHOICES = (240, 120, 60, 24, 12)
#: `lanes="auto"` never picks fewer (unless the table has fewer rows).
MIN_LANES = 12
#: `lanes="auto"`: at least this many units (row groups) per lane, so a lane's two partial units stay a small
#: part of what it reads.
UNITS_PER_LANE = 8
#: `shuffle_window="auto"`: one block of every lane (what one process holds to put global batches together)
#: takes about this many decoded bytes.
WINDOW_BYTES = 32 << 20
DEFAULT_READ_AHEAD = 256 << 20
DEFAULT_SEED = 20170601


def auto_lanes(plan: Plan) -> int:
    """The lanes for `lanes="auto"`: the largest of `LANE_CHOICES` leaving `UNITS_PER_LANE` units per lane, and
    at least 12 (every world size up to 4, and 6 and 12, divides it: a small table's lanes then share row
    groups, which costs decoding them more than once, not reading more of the store than it holds)."""
    for lanes in LANE_CHOICES:
        if plan.units >= lanes * UNITS_PER_LANE and plan.rows >= lanes:
            return lanes
    return min(MIN_LANES, max(plan.rows, 1))


def auto_window(plan: Plan, lanes: int, budget: int = DEFAULT_READ_AHEAD) -> int:
    """The shuffle window for `shuffle_window="auto"`: a block of all `lanes` within `WINDOW_BYTES`, at most a lane,
    and small enough that one process (which holds every lane) fits `budget` (`budget.check_budget`): its
    lanes' open row groups, two blocks decoded twice (rows and arrays) and a quarter for finished steps. Only
    the budget and the table decide it, never the world size, so the order is the same on any number of workers.
    """
    lane_rows = max(1, -(-plan.rows // lanes))
    row_bytes = max(plan.row_bytes, 1.0)
    window = WINDOW_BYTES // max(1, int(lanes * row_bytes))
    room = budget - budget // 4 - lanes * lane_bytes(plan)
    if room > 0:        # else check_budget refuses the budget, naming the lanes' bytes and the fix
        window = min(window, int(room // (4 * lanes * row_bytes)))
    return int(min(max(1, window), lane_rows))


class TableInput:
    """A `Table` read as `(x, y[, sample_weight])` batches (see the module docstring).

    Args:
        table: the `stratkit.data.Table`.
        features: the column(s) feeding the model's input(s) (one name, or a list: `feed.py`'s rule).
        label: the label column (None for a model trained without one).
        sample_weight: a column of per-row weights.
        seed: the order's seed (default: `Trainer(seed=...)`'s in `Trainer.fit`, else stratkit's default; the
            same on every worker).
        shuffle: False reads the units in the plan's order and each window in order, the lanes interleaved row
            by row (validation); the table's own row order only with `lanes=1`.
        shuffle_window: rows each lane shuffles together ("auto": a block of all lanes ~32 MiB decoded).
        lanes: the canonical partition count the order is built on ("auto": from the table, see `auto_lanes`);
            fixed for a run and recorded in its backups. World sizes that divide it share the rows evenly.
        read_ahead_bytes: decoded bytes a worker's reader may hold ahead of the step.
        threads: decode threads per worker.
    """

    def __init__(self, table: Table, features: str | Sequence[str], label: str | None = None,
                 sample_weight: str | None = None, *, seed: int | None = None, shuffle: bool = True,
                 shuffle_window: int | str = "auto", lanes: int | str = "auto",
                 read_ahead_bytes: int = DEFAULT_READ_AHEAD, threads: int = 4) -> None:
        if not isinstance(table, Table):
            raise ConfigError(f"TableInput takes a stratkit.data.Table, not {type(table).__name__}. Fix: "
                              "TableInput(Table.parquet(url), features=..., label=...)")
        for name, value in (("shuffle_window", shuffle_window), ("lanes", lanes)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be 'auto' or a positive integer")
        if isinstance(read_ahead_bytes, bool) or not isinstance(read_ahead_bytes, int) or read_ahead_bytes < 1:
            raise ConfigError(f"read_ahead_bytes={read_ahead_bytes!r} must be a positive number of bytes, e.g. "
                              f"{DEFAULT_READ_AHEAD}")
        self.features = [features] if isinstance(features, str) else list(features)
        self.single = isinstance(features, str)
        self.label = label
        self.sample_weight = sample_weight
        self.seed = DEFAULT_SEED if seed is None else int(seed)
        self.seed_given = seed is not None        # else Trainer.fit gives its own (`Trainer(seed=...)`)
        self.shuffle = bool(shuffle)
        self.shuffle_window = shuffle_window
        self.lanes = lanes
        self.read_ahead_bytes = int(read_ahead_bytes)
        self.threads = max(1, int(threads))
        self.note: str | None = None  # what a resume changed that it accepts (said once)
        wanted = [*self.features, *(n for n in (label, sample_weight) if n is not None)]
        planned = table.planned          # a driver planned it once: keep its plan (all its columns)
        self.table = table if table.columns is not None or planned else table.with_columns(wanted)

    # -- the plan and its order -----------------------------------------------------------------------
    def plan(self) -> Plan:
        return self.table.plan()

    @property
    def num_rows(self) -> int:
        return self.plan().rows

    def layout(self) -> Layout:
        plan = self.plan()
        if plan.rows == 0:
            raise ConfigError(f"the table {self.table!r} has no rows. Fix: check the path, the version and the "
                              "filter")
        lanes = auto_lanes(plan) if self.lanes == "auto" else int(self.lanes)
        window = (auto_window(plan, lanes, self.read_ahead_bytes) if self.shuffle_window == "auto"
                  else int(self.shuffle_window))
        return Layout(plan.rows, lanes, window)

    def record(self) -> OrderRecord:
        """What a backup records of this input: the snapshot and the order's settings."""
        plan, layout = self.plan(), self.layout()
        return OrderRecord(source=plan.source, fingerprint=plan.fingerprint, rows=plan.rows, seed=self.seed,
                           lanes=layout.lanes, window=layout.window, shuffle=self.shuffle)

    def _copy(self, **changes: Any) -> TableInput:
        out = object.__new__(TableInput)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(changes)
        return out

    def pinned(self, record: OrderRecord | dict | None, *, mid_pass: bool = False, backup: str = "") -> TableInput:
        """This input reading the snapshot and order a backup recorded (its settings unless given explicitly).

        Raises:
            ConfigError: the table's files changed, or (mid-pass) an order setting differs from the backup's.
        """
        saved = record if isinstance(record, OrderRecord) or record is None else OrderRecord.from_dict(record)
        if saved is None:
            return self
        out = self._copy(table=self.table.pinned(saved.source),
                         lanes=saved.lanes if self.lanes == "auto" else self.lanes,
                         shuffle_window=saved.window if self.shuffle_window == "auto" else self.shuffle_window,
                         seed=self.seed if self.seed_given else saved.seed, seed_given=True,
                         shuffle=self.shuffle and saved.shuffle)
        out.note = check_resume(saved, out.record(), mid_pass=mid_pass, backup=backup)
        return out

    def with_order(self, seed: int, shuffle: bool) -> TableInput:
        """This input with the trainer's seed (unless one was given) and `shuffle` (Trainer.fit's)."""
        return self._copy(seed=self.seed if self.seed_given else int(seed), shuffle=self.shuffle and shuffle)

    def at_version(self, version: int) -> TableInput:
        """A Delta table's input pinned to `version` (the version every worker agreed on)."""
        return self._copy(table=self.table.at_version(version))

    # -- steps -----------------------------------------------------------------------------------------
    def steps_per_epoch(self, global_batch_size: int) -> int:
        """Global batches in one pass over the table: ceil(rows / global_batch_size), the last one partial."""
        return steps_for(self.num_rows, _batch(global_batch_size))

    # -- one worker's reader ---------------------------------------------------------------------------
    def feed(self, model: Any = None) -> Batcher:
        plan = self.plan()
        feed = Batcher(plan.columns, self.features[0] if self.single else self.features, self.label,
                       self.sample_weight, model=model)
        feed.check_bounds(plan.bounds)
        return feed

    def reader(self, global_batch_size: int, world: int = 1, rank: int = 0, *, replicas: int = 1, model: Any = None,
               start: Cursor = Cursor(), passes: int | None = None, feed: Batcher | None = None) -> WorkerReader:
        """Worker `rank` of `world`'s batches: an iterator of steps, each a list of `replicas` per-replica
        `(x, y[, sample_weight])` tuples of numpy arrays, from `start` on (`passes`: how many, None: endless).
        `close()` it when done."""
        spec = ReaderSpec(plan=self.plan(), layout=self.layout(), seed=self.seed, shuffle=self.shuffle,
                          world=int(world), rank=int(rank), batch=_batch(global_batch_size),
                          replicas=int(replicas), start=start, passes=passes, budget=self.read_ahead_bytes,
                          threads=self.threads)
        return WorkerReader(spec, feed if feed is not None else self.feed(model))

    def dataset_fn(self, global_batch_size: int, model: Any = None, *, epoch: int = 0, step: int = 0,
                   steps_per_epoch: int | None = None, passes: int | None = None) -> Callable[[Any], Any]:
        """`dataset_fn(input_context)` for `strategy.distribute_datasets_from_function`: each worker's
        per-replica batches from (epoch, step) on (endless, or `passes` passes), as a `tf.data.Dataset`.

        With a hand-written fit::

            strategy = stratkit.make_strategy()
            ...
            dataset = strategy.distribute_datasets_from_function(data.dataset_fn(256, model=model))
            model.fit(dataset, epochs=3, steps_per_epoch=data.steps_per_epoch(256))
        """
        batch = _batch(global_batch_size)
        start = Cursor.at(epoch, step, rows=self.num_rows, batch_size=batch, steps_per_epoch=steps_per_epoch)
        feed = self.feed(model)
        specs = feed.specs()

        def dataset_fn(input_context: Any) -> Any:
            import tensorflow as tf

            world = int(input_context.num_input_pipelines)
            rank = int(input_context.input_pipeline_id)
            replicas = max(1, int(input_context.num_replicas_in_sync) // max(world, 1))

            def chunks() -> Any:
                reader = self.reader(batch, world, rank, replicas=replicas, start=start, passes=passes, feed=feed)
                try:
                    for chunk in reader.chunks():
                        yield from chunk.stacked(feed)
                finally:
                    reader.close()

            # Runs of equal per-replica parts, cut by `unbatch` in C++ (no graph function per step). TensorFlow
            # 2.21's unbatch crashes the process on an element with an empty axis (a run of empty parts): a worker
            # with such steps cuts each run with `from_tensor_slices` instead.
            signature = tf.nest.map_structure(lambda s: tf.TensorSpec((None, *s.shape), s.dtype), specs)
            dataset = tf.data.Dataset.from_generator(chunks, output_signature=signature).prefetch(1)
            if has_empty_parts(self.layout(), batch, world, rank, replicas):
                dataset = dataset.flat_map(lambda *run: tf.data.Dataset.from_tensor_slices(run))
            else:
                dataset = dataset.unbatch()
            # No tf.data autotuning: nothing here has a tunable knob (the read-ahead is ours), and its model thread
            # held the iterator's end up to 0.3 s in 4 of 15 passes (measured; none in 15 without it).
            options = tf.data.Options()
            options.autotune.enabled = False
            # No prefetch after `unbatch`: the next chunk is ready in the one before it, and a step's parts are
            # slices of it; one thread fewer on the cores the step runs on (10 alternating passes: 117k -> 126k
            # rows/s of the CNN's table, 3.22M -> 3.30M of bench_lake's; the CNN 0.86x -> 0.88x).
            return dataset.with_options(options)

        return dataset_fn

    def __repr__(self) -> str:
        return f"TableInput({self.table!r}, features={self.features!r}, label={self.label!r})"


def planned(data: TableInput) -> TableInput:
    """`data` planned on the driver, as the tasks get it (a Delta table without a version pinned to its latest):
    every runner plans a `TableInput` argument here once (`process.payload.pickle_payload`, Spark's
    `in_place`), so a table that cannot be read is a ConfigError before any process starts and no task lists
    the files or reads the footers.

    Raises:
        ConfigError: the table cannot be planned (a missing path or column, files whose schemas differ, ...).
    """
    if data.table.kind == "delta" and data.table.version is None:
        data = data.at_version(int(data.table.latest_version() or 0))
    data.plan()
    return data


def _batch(global_batch_size: Any) -> int:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive integer: got {global_batch_size!r}")
    return int(global_batch_size)


def lanes_note(layout: Layout, world: int) -> str | None:
    """What a world size that does not divide the lanes costs (said once at fit start), None when it divides."""
    if layout.lanes % world == 0:
        return None
    if world > layout.lanes:
        return (f"{world} workers over {layout.lanes} lanes: {world - layout.lanes} worker(s) read no rows (they "
                f"take part in every step with empty batches). Fix: lanes= a multiple of the world size")
    most = math.ceil(layout.lanes / world)
    return (f"{layout.lanes} lanes over {world} workers: some read {most} lanes, others {layout.lanes // world} "
            f"(the largest share {most * world / layout.lanes:.2f}x the mean). Fix: lanes= a multiple of {world}")


__all__ = ["DEFAULT_READ_AHEAD", "LANE_CHOICES", "TableInput", "auto_lanes", "auto_window", "lanes_note", "planned"]
