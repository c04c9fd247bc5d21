"""A Spark DataFrame as training input: staged as Parquet, read per worker with pyarrow.

Size: the driver's marker (`DataFrameInput`), the tasks' file table (`StagedData`) and the worker's shard with its
readers (`ParquetShard`: record batches, the model's plan, numpy, tf.data) are one contract about the same staged
columns; the column rule itself is the data layer's (`stratkit.data.feeds`).

Driver side (`DataFrameInput`; the staging itself: `stratkit.spark.staging`):
the DataFrame's feature and label columns are written once as Parquet to a
staging directory every executor can read (a local temp dir on
`local`/`local-cluster` masters; on a real cluster a store URL such as
s3://, gs://, az://, hdfs:// or a mounted path, from `staging_dir=` or the
conf `spark.stratkit.stagingDir`), and every task gets the same small file
table: no data travels through the Spark closure.

Each column is staged in its own type (Parquet keeps int64, float64, strings
and arrays; a Spark ML vector becomes an array of float64), and reaches the
model in the type its input asks for by `stratkit.data.columns`: with
`dataset_fn(global_batch, model=model)` every column feeds its model input by
the rule of `stratkit.data.feeds` (one column per input in `model.inputs`
order, in the model's list / tuple / dict structure, labels in its outputs'),
int64 ids stay exact and strings reach string inputs. A cast that would change
a value (int64 ids above 2^24 into float32, a fractional float into an int) is
a `ConfigError` naming the column, from the min/max the staging executors
reported before a row is read, else as the batch is read. Without a model the
shard yields what it always did: the feature columns side by side as one
matrix of `feature_dtype` (float32 unless set), with the same checks.

Worker side (`ParquetShard`, what train_fn receives instead of the
DataFrame): worker i of W reads the contiguous rows
[floor(i*N/W), floor((i+1)*N/W)) of the files in name order -- mostly its own
files, skipping whole row groups it does not own -- so every row belongs to
exactly one worker and shard sizes differ by at most one row.

Keras' multi-worker input rule still applies: every worker must run the same
number of steps per epoch. `steps_per_epoch(global_batch_size)` is the same
number on every worker, and `dataset_fn(global_batch_size)` yields exactly
that many per-replica batches per pass (then repeats, reshuffled), so each row
is seen once per epoch across the workers. The one exception is a remainder
smaller than the number of workers: when the largest shard needs one batch
more than the smallest (N mod (W x per-replica batch) in 1..W-1), that last
small batch is skipped for the epoch (a different row each epoch, as shards are
reshuffled), because a worker with no rows left cannot take part in the step.
No Petastorm: the table reader's Parquet source (`stratkit.data.sources`) reads the rows, through the
store layer's filesystems; `table_input()` reads the staged copy as a table in place is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratkit.data.columns import Column
from stratkit.data.feeds import FeedPlan, Names, plan_feeds, plan_for_model
from stratkit.data.signature import ModelSignature, Port
from stratkit.errors import ConfigError
from stratkit.training.inputs.rules import check_divisible

DEFAULT_SEED = 20170601
#: The feature matrix's dtype when no model says (`DataFrameInput(feature_dtype=None)`, the old default).
MATRIX_DTYPE = "float32"
#: `DataFrameInput`'s argument names, for messages.
NAMES = Names(features="feature_cols", labels="label_col", weight="weight_col")


class DataFrameInput:
    """Marks a Spark DataFrame argument of `SparkRunner.run` and says how to read it.

    `runner.run(train_fn, data=df)` is the same as
    `runner.run(train_fn, data=DataFrameInput(df))`; wrap the DataFrame to
    choose columns or the staging directory. In train_fn the argument arrives
    as a `ParquetShard` (this worker's rows).

    Args:
        df: the DataFrame.
        feature_cols: the feature columns, in order (numbers, strings, arrays of them, Spark ML vectors);
            default: every column except the label and weight columns.
        label_col: the label column, or a list of them (one per model output, in the model's output order);
            None for unlabeled data. Default "label" (None when the DataFrame has no such column).
        staging_dir: where the Parquet copy is written (a directory or store URL all
            executors can read: s3://, gs://, az://, hdfs://, a shared mount); default: conf
            spark.stratkit.stagingDir, else a temp dir on local masters. The run's part of it
            is removed after the run.
        feature_dtype: the dtype of the one feature matrix a shard yields when no model is given
            (`dataset_fn(global_batch)`, `to_numpy()`; default float32). With `model=` each column takes its
            model input's dtype, so it must stay None there.
        weight_col: a column of per-row sample weights, yielded after the labels.
        in_place: False (default): always stage; train_fn receives a `ParquetShard` with all its methods.
            None: a DataFrame that is exactly a scan of a Parquet table (`spark.read.parquet(p)`, maybe a
            `select` of columns) is read in place by every worker, with no staging copy, and train_fn receives
            a `stratkit.data.TableInput` for `Trainer.fit` (`stratkit.spark.in_place` decides); any other
            DataFrame is staged. True: read in place or raise a `ConfigError` saying why it cannot be.
            (`KerasEstimator`, whose train_fn is stratkit's own, reads a scan in place by default: `readInPlace`.)

    Raises:
        ConfigError: a column that is not in the DataFrame, or named twice; `in_place` not None/True/False.
    """

    def __init__(self, df: Any, feature_cols: Sequence[str] | str | None = None,
                 label_col: str | Sequence[str] | None = "label", staging_dir: str | None = None,
                 feature_dtype: str | None = None, weight_col: str | None = None,
                 in_place: bool | None = False) -> None:
        if in_place not in (None, True, False):
            raise ConfigError(f"in_place={in_place!r} must be False (always stage), None (read a "
                              "Parquet scan in place, stage the rest) or True (read in place or refuse)")
        self.df = df
        self.in_place = in_place
        #: How messages name this input and the setting that stages it (`KerasEstimator` gives its own words).
        self.described = ("argument {name!r}", "DataFrameInput(df, in_place=False)", "DataFrameInput(in_place=True)")
        names = list(df.columns)
        if label_col == "label" and "label" not in names and feature_cols is None:
            label_col = None  # the default, on an unlabeled DataFrame
        labels = [] if label_col is None else [label_col] if isinstance(label_col, str) else list(label_col)
        for what, chosen in (("label_col", labels), ("weight_col", [weight_col] if weight_col else [])):
            missing = [c for c in chosen if c not in names]
            if missing:
                raise ConfigError(f"{what}={label_col if what == 'label_col' else weight_col!r} names "
                                  f"{missing}, not columns of the DataFrame (columns: {names}). Fix: pass "
                                  f"{what}=<one of them>, or {what}=None")
        others = labels + ([weight_col] if weight_col else [])
        if isinstance(feature_cols, str):
            feature_cols = [feature_cols]
        if feature_cols is None:
            feature_cols = [c for c in names if c not in others]
        feature_cols = list(feature_cols)
        missing = [c for c in feature_cols if c not in names]
        if missing or not feature_cols:
            raise ConfigError(f"feature_cols={feature_cols!r} must name existing columns (missing: {missing}; "
                              f"columns: {names}). Fix: e.g. feature_cols={[c for c in names if c not in others][:3]}")
        every = feature_cols + others
        repeated = sorted({c for c in every if every.count(c) > 1})
        if repeated:
            raise ConfigError(f"column(s) {repeated} appear more than once in feature_cols/label_col/weight_col. "
                              "Fix: a label is not a feature; name each column once")
        self.feature_cols = feature_cols
        self.label_cols = labels
        #: The label column as given: a name, a list of names, or None.
        self.label_col = labels[0] if isinstance(label_col, str) else (list(labels) or None)
        self.weight_col = weight_col
        self.staging_dir = staging_dir
        self.feature_dtype = feature_dtype

    @property
    def columns(self) -> list[str]:
        """Every column staged: features, labels, then the weight."""
        return self.feature_cols + self.label_cols + ([self.weight_col] if self.weight_col else [])


@dataclass(frozen=True)
class StagedData:
    """A staged DataFrame, as the tasks see it: the file table and the column mapping (small, picklable)."""

    path: str
    files: tuple[tuple[str, int], ...]  # (path or URL, rows) in read order
    feature_cols: tuple[str, ...]
    label_col: str | tuple[str, ...] | None = None  # one label column, or one per model output
    weight_col: str | None = None
    feature_dtype: str | None = None
    #: (column, smallest value, largest value) of each numeric column, as the staging executors reported them.
    stats: tuple[tuple[str, Any, Any], ...] = ()
    owned: bool = field(default=False, compare=False)  # the runner created the directory and removes it

    @property
    def label_cols(self) -> tuple[str, ...]:
        """The label columns (none, one, or one per model output)."""
        if self.label_col is None:
            return ()
        return (self.label_col,) if isinstance(self.label_col, str) else tuple(self.label_col)

    @property
    def columns(self) -> tuple[str, ...]:
        return self.feature_cols + self.label_cols + ((self.weight_col,) if self.weight_col else ())

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows in self.files)

    def shard(self, index: int, count: int) -> ParquetShard:
        """Worker `index` of `count`'s share of the rows."""
        return ParquetShard(self, index, count)

    def table(self, uris: Sequence[str] | None = None) -> Any:
        """The staged files `uris` (default: every one with rows) as a `stratkit.data.Table` of the staged columns."""
        from stratkit.data.table import Table

        chosen = [uri for uri, rows in self.files if rows] if uris is None else list(uris)
        if not chosen:
            raise ConfigError("the staged DataFrame has no rows")
        return Table.parquet(chosen, columns=list(self.columns))


class ParquetShard:
    """One worker's rows of a staged DataFrame; what train_fn receives for a DataFrame argument.

    Nothing is read (and TensorFlow is not imported) until a method is called,
    so train_fn can create its strategy / `stratkit.Trainer` first, as
    multi-worker TensorFlow requires.

    Typical use in train_fn::

        trainer = stratkit.Trainer()
        model = trainer.build(build_and_compile)
        global_batch = 32 * trainer.num_replicas
        trainer.fit(model, data.dataset_fn(global_batch, model=model),
                    steps_per_epoch=data.steps_per_epoch(global_batch, trainer.num_replicas), epochs=5)

    With `model=` (`dataset_fn`, `dataset`, `iter_batches`, `to_numpy`) each batch is
    `(inputs, labels[, weights])` in the model's structures, every column in the type its input takes
    (`stratkit.data.feeds`); without, `(x, y)` with the feature columns side by side in one matrix of
    `feature_dtype` (float32 unless set).
    """

    def __init__(self, staged: StagedData, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ConfigError(f"shard index {index} is outside 0..{count - 1}")
        self.staged = staged
        self.index = index
        self.count = count
        total = staged.num_rows
        self.start = index * total // count
        self.stop = (index + 1) * total // count
        self._schema: dict[str, Column] | None = None
        self._plan: tuple[Any, int, int] | None = None

    @property
    def num_rows(self) -> int:
        """Rows of this worker's shard."""
        return self.stop - self.start

    @property
    def total_rows(self) -> int:
        """Rows of the whole DataFrame."""
        return self.staged.num_rows

    def shard_sizes(self) -> list[int]:
        """Rows of every worker's shard (the same list on every worker)."""
        total = self.staged.num_rows
        return [(i + 1) * total // self.count - i * total // self.count for i in range(self.count)]

    # -- reading ----------------------------------------------------------------------------------
    def _planned(self) -> tuple[Any, int, int]:
        """(the plan of the files holding the shard's rows, or of the first file with rows; first row, end row)."""
        if self._plan is None:
            import numpy as np

            uris, first, at = [], self.start, 0
            for uri, rows in self.staged.files:
                if rows and at + rows > self.start and at < self.stop:
                    first = at if not uris else first
                    uris.append(uri)
                at += rows
            uris = uris or [uri for uri, rows in self.staged.files if rows][:1]   # no rows here: one, for the schema
            plan = self.staged.table(uris).plan()
            staged = dict(self.staged.files)
            found = np.bincount(plan.unit_file, weights=plan.unit_rows, minlength=len(plan.files)).astype(int).tolist()
            if found != [staged[uri] for uri in uris]:
                raise ConfigError(f"the staged files {uris} hold {found} rows, not the {[staged[u] for u in uris]} "
                                  "the staging wrote: the staging directory was changed during the run. Fix: "
                                  "give each run a staging directory of its own (staging_dir=)")
            self._plan = (plan, self.start - first, self.stop - first)
        return self._plan

    def record_batches(self, batch_rows: int = 4096) -> Iterator[Any]:
        """This shard's rows as Arrow `RecordBatch`es in file order, every staged column in its own type.

        Read by the table reader's Parquet source (`stratkit.data.sources`), the one that reads tables in place:
        only the row groups holding the shard's rows, only the staged columns."""
        import numpy as np

        from stratkit.data import sources
        from stratkit.data.plan import Stream
        from stratkit.storage.arrow import arrow_filesystem

        plan, first, stop = self._planned()
        if first >= stop:
            return
        fs = arrow_filesystem(plan.root, "the staged DataFrame")[0]
        footers: dict[int, Any] = {}
        for piece in Stream(plan, np.arange(len(plan.unit_rows))).pieces(first, stop):
            yield from sources.read_piece(plan, piece, list(self.staged.columns), batch_rows, fs, footers)

    def schema(self) -> dict[str, Column]:
        """Each staged column's dtype and per-row shape (`stratkit.data.columns.Column`), from the Parquet schema."""
        if self._schema is None:
            plan = self._planned()[0]
            self._schema = {column.name: column for column in plan.columns}
        return self._schema

    def plan(self, model: Any = None, names: Names = NAMES) -> FeedPlan:
        """Which staged columns feed which input of `model` (`stratkit.data.feeds`), checked against the min/max
        the staging executors reported (a lossy cast refused before any row is read). `model` None: the feature
        columns side by side as one matrix of `feature_dtype`; a `FeedPlan`: itself.

        Raises:
            ConfigError: a column that fits no input, a cast that would change a value, naming the column.
        """
        if isinstance(model, FeedPlan):
            return model
        schema = self.schema()
        features = [schema[c] for c in self.staged.feature_cols]
        labels = [schema[c] for c in self.staged.label_cols]
        weight = schema[self.staged.weight_col] if self.staged.weight_col else None
        stats = {name: (low, high) for name, low, high in self.staged.stats}
        if model is not None:
            if self.staged.feature_dtype is not None:
                raise ConfigError(f"feature_dtype={self.staged.feature_dtype!r} and model= both choose the features' "
                                  "dtypes. Fix: drop feature_dtype from the DataFrameInput: with model= each column "
                                  "takes its model input's dtype")
            plan = plan_for_model(model, features, labels, weight, names)
            plan.check_ranges(stats)
            return plan
        matrix = ModelSignature((Port("features", (None,), self.staged.feature_dtype or MATRIX_DTYPE),), ())
        plan = plan_feeds(matrix, features, labels, weight, names)
        try:
            plan.check_ranges(stats)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; or pass model=model to dataset_fn (each column then takes its model input's "
                              "dtype), or feature_dtype= that holds the values") from None
        return plan

    def iter_batches(self, batch_rows: int = 4096, model: Any = None) -> Iterator[tuple[Any, ...]]:
        """This shard's rows as numpy batches in file order: without `model`, `(x, y)` (`y` None without a label,
        a tuple for several; `(x, y, w)` with a weight column); with it, `(inputs, labels[, weights])` as
        `Batch.element()` gives them (`(inputs,)` unlabeled)."""
        plan = self.plan(model)
        for batch in self.record_batches(batch_rows):
            converted = plan.convert(batch)
            if model is not None:
                yield converted.element()
            else:
                yield (converted.inputs, converted.labels) + (() if converted.weights is None else
                                                              (converted.weights,))

    def column_widths(self) -> dict[str, int]:
        """Values per row of each staged column (1 for a scalar), from the schema or the first row."""
        from stratkit.data.columns import to_numpy

        schema = self.schema()
        batch = None
        widths = {}
        for name, column in schema.items():
            if column.width is None:
                batch = batch if batch is not None else next(self.record_batches(batch_rows=1))
                widths[name] = int(to_numpy(batch.column(name), column, column.dtype)[0].size)
            else:
                widths[name] = column.width
        return widths

    def to_numpy(self, model: Any = None) -> tuple[Any, ...]:
        """The whole shard in memory, as `iter_batches(model=model)` gives it in one batch."""
        parts = list(self.iter_batches(model=model))
        if not parts:
            raise ConfigError(f"shard {self.index} of {self.count} has no rows")
        return _joined(parts)

    def _element(self, plan: FeedPlan, batch: Any, legacy: bool) -> Any:
        converted = plan.convert(batch)
        if not legacy or converted.labels is not None:
            return converted.element()
        return converted.inputs

    def dataset(self, model: Any = None) -> Any:
        """This shard as an unbatched `tf.data.Dataset` in file order: with `model`, of `(inputs, labels[,
        weights])` in the model's structures; without, of `(x, y)` (or `x`) as before.

        Auto-sharding is OFF on it: the rows are already this worker's share.
        For `model.fit` under a multi-worker strategy, prefer `dataset_fn`,
        which also keeps the step count equal on every worker.
        """
        import tensorflow as tf

        plan = self.plan(model)
        legacy = model is None

        def generate() -> Iterator[Any]:
            for batch in self.record_batches():
                yield self._element(plan, batch, legacy)

        first = self._element(plan, next(self.record_batches(batch_rows=1)), legacy)
        spec = tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.string if a.dtype == object
                                                             else tf.as_dtype(a.dtype)), first)
        dataset = tf.data.Dataset.from_generator(generate, output_signature=spec).unbatch()
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return dataset.with_options(options)

    def steps_per_epoch(self, global_batch_size: int, num_replicas: int | None = None) -> int:
        """Steps per epoch for `dataset_fn(global_batch_size)`; the same number on every worker.

        Args:
            global_batch_size: examples per step across all replicas.
            num_replicas: replicas in sync (`trainer.num_replicas`); default:
                one per worker (CPU workers).
        """
        replicas = self.count if num_replicas is None else num_replicas
        per_replica = self._per_replica(global_batch_size, replicas)
        local = replicas // self.count
        steps = min(math.ceil(size / per_replica) // local for size in self.shard_sizes())
        if steps < 1:
            raise ConfigError(f"global_batch_size={global_batch_size} leaves no full step: the smallest shard has "
                              f"{min(self.shard_sizes())} rows for {local} replica(s) of {per_replica}. "
                              "Fix: use a smaller batch or fewer workers")
        return steps

    def _per_replica(self, global_batch_size: int, replicas: int) -> int:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be a positive integer: got {global_batch_size!r}. "
                              "Fix: e.g. 32 * trainer.num_replicas")
        if replicas < self.count or replicas % self.count:
            raise ConfigError(f"num_replicas={replicas} is not a multiple of the {self.count} workers. "
                              "Fix: pass trainer.num_replicas (or strategy.num_replicas_in_sync)")
        check_divisible(global_batch_size, replicas)
        return global_batch_size // replicas

    def dataset_fn(self, global_batch_size: int, shuffle: bool = True, seed: int = DEFAULT_SEED,
                   shuffle_buffer: int = 10_000, model: Any = None) -> Any:
        """A `dataset_fn(input_context)` for `Trainer.fit` / `strategy.distribute_datasets_from_function`.

        Each pass yields exactly `steps_per_epoch` batches per replica from this
        worker's rows (reshuffled every pass when `shuffle`), then repeats, so
        Keras' `steps_per_epoch` epochs line up with passes over the data.

        Args:
            global_batch_size: examples per step across all replicas.
            shuffle: reshuffle this worker's rows every pass.
            seed: the shuffle's seed (worker i adds i).
            shuffle_buffer: rows held for the shuffle (at most the shard's).
            model: the Keras model (or a `FeedPlan`) the batches are for: each is `(inputs, labels[, weights])`
                in its structures, each column in its input's type. Planned here, so a column that fits no
                input or a cast that would change a value is a `ConfigError` now, before `fit`.
        """
        plan = self.plan(model)
        legacy = model is None

        def fn(input_context: Any) -> Any:
            import tensorflow as tf

            if input_context.num_input_pipelines != self.count:
                raise ConfigError(f"the strategy has {input_context.num_input_pipelines} input pipeline(s) but the "
                                  f"DataFrame was split for {self.count} workers. Fix: use the strategy "
                                  "stratkit.Trainer()/make_strategy() builds on the Spark runner's cluster")
            replicas = input_context.num_replicas_in_sync
            per_replica = self._per_replica(global_batch_size, replicas)
            steps = self.steps_per_epoch(global_batch_size, replicas)
            dataset = self.dataset(None if legacy else plan)
            if shuffle:
                dataset = dataset.shuffle(max(1, min(self.num_rows, shuffle_buffer)), seed=seed + self.index,
                                          reshuffle_each_iteration=True)
            local = replicas // self.count
            dataset = dataset.batch(per_replica).take(steps * local).repeat()
            return dataset.prefetch(tf.data.AUTOTUNE)

        return fn

    def table_input(self, *, seed: int | None = None, shuffle: bool = True, **options: Any) -> Any:
        """The whole staged copy as a `stratkit.data.TableInput` (the same on every worker), for
        `trainer.fit(model, data.table_input(), global_batch_size=G)`: each row once per epoch, the last batch
        partial, one order at any number of workers. The copy is the run's own: a mid-epoch backup serves a
        retry of this run, not a new run (which stages anew).

        Args:
            seed: the order's seed (as `TableInput`'s).
            shuffle: shuffle the order (as `TableInput`'s).
            **options: `TableInput`'s `shuffle_window`, `lanes`, `read_ahead_bytes`, `threads`.

        Raises:
            ConfigError: several label columns, or `feature_dtype` (each column takes its model input's dtype).
        """
        from stratkit.data.table_input import TableInput

        if len(self.staged.label_cols) > 1:
            raise ConfigError(f"table_input() takes one label column, not {list(self.staged.label_cols)}. Fix: "
                              "DataFrameInput(label_col=<one column>), or this shard's dataset_fn(G, model=model)")
        if self.staged.feature_dtype is not None:
            raise ConfigError(f"table_input() gives each column its model input's dtype, and feature_dtype="
                              f"{self.staged.feature_dtype!r} chose one for all. Fix: drop feature_dtype from the "
                              "DataFrameInput")
        return TableInput(self.staged.table(), features=list(self.staged.feature_cols),
                          label=self.staged.label_cols[0] if self.staged.label_cols else None,
                          sample_weight=self.staged.weight_col, seed=seed, shuffle=shuffle, **options)

    def __repr__(self) -> str:
        return (f"ParquetShard(index={self.index}, count={self.count}, rows={self.num_rows} of {self.total_rows}, "
                f"features={list(self.staged.feature_cols)}, labels={list(self.staged.label_cols)})")


def _joined(parts: list[Any]) -> Any:
    """Batches of one nested structure of numpy arrays (None leaves kept) joined along the rows."""
    import numpy as np

    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: _joined([p[key] for p in parts]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_joined([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)
