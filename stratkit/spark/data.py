"""A Spark DataFrame as training input: staged as Parquet, read per worker with pyarrow.

Driver side (`DataFrameInput`; the staging itself: `stratkit.spark.staging`):
the DataFrame's feature and label columns are written once as Parquet to a
staging directory every executor can read (a local temp dir on
`local`/`local-cluster` masters; on a real cluster a store URL such as
s3://, gs://, az://, hdfs:// or a mounted path, from `staging_dir=` or the
conf `spark.stratkit.stagingDir`), and every task gets the same small file
table: no data travels through the Spark closure.

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
No Petastorm: pyarrow reads Parquet directly, through the store layer
(`stratkit.storage`), so a store URL reads as a local directory does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.training.inputs.rules import check_divisible

DEFAULT_SEED = 20170601


class DataFrameInput:
    """Marks a Spark DataFrame argument of `SparkRunner.run` and says how to read it.

    `runner.run(train_fn, data=df)` is the same as
    `runner.run(train_fn, data=DataFrameInput(df))`; wrap the DataFrame to
    choose columns or the staging directory. In train_fn the argument arrives
    as a `ParquetShard` (this worker's rows).

    Args:
        df: the DataFrame.
        feature_cols: columns that form the feature vector, in order (numeric
            scalars, arrays of numbers, or Spark ML vectors); default: every
            column except `label_col`.
        label_col: the label column; None for unlabeled data. Default "label"
            (None when the DataFrame has no such column).
        staging_dir: where the Parquet copy is written (a directory or store URL all
            executors can read: s3://, gs://, az://, hdfs://, a shared mount); default: conf
            spark.stratkit.stagingDir, else a temp dir on local masters. The run's part of it
            is removed after the run.
        feature_dtype: numpy dtype of the feature matrix.
    """

    def __init__(self, df: Any, feature_cols: Sequence[str] | str | None = None, label_col: str | None = "label",
                 staging_dir: str | None = None, feature_dtype: str = "float32") -> None:
        self.df = df
        names = list(df.columns)
        if label_col is not None and label_col not in names:
            if label_col == "label" and feature_cols is None:
                label_col = None  # the default, on an unlabeled DataFrame
            else:
                raise ConfigError(f"label_col={label_col!r} is not a column of the DataFrame (columns: {names}). "
                                  "Fix: pass label_col=<one of them>, or label_col=None for unlabeled data")
        if isinstance(feature_cols, str):
            feature_cols = [feature_cols]
        if feature_cols is None:
            feature_cols = [c for c in names if c != label_col]
        feature_cols = list(feature_cols)
        missing = [c for c in feature_cols if c not in names]
        if missing or not feature_cols:
            raise ConfigError(f"feature_cols={feature_cols!r} must name existing columns (missing: {missing}; "
                              f"columns: {names}). Fix: e.g. feature_cols={[c for c in names if c != label_col][:3]}")
        if label_col is not None and label_col in feature_cols:
            raise ConfigError(f"label_col={label_col!r} is also in feature_cols={feature_cols!r}. "
                              "Fix: remove the label from the features")
        self.feature_cols = feature_cols
        self.label_col = label_col
        self.staging_dir = staging_dir
        self.feature_dtype = feature_dtype


@dataclass(frozen=True)
class StagedData:
    """A staged DataFrame, as the tasks see it: the file table and the column mapping (small, picklable)."""

    path: str
    files: tuple[tuple[str, int], ...]  # (path or URL, rows) in read order
    feature_cols: tuple[str, ...]
    label_col: str | None
    feature_dtype: str = "float32"
    owned: bool = field(default=False, compare=False)  # the runner created the directory and removes it

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows in self.files)

    def shard(self, index: int, count: int) -> ParquetShard:
        """Worker `index` of `count`'s share of the rows."""
        return ParquetShard(self, index, count)


class ParquetShard:
    """One worker's rows of a staged DataFrame; what train_fn receives for a DataFrame argument.

    Nothing is read (and TensorFlow is not imported) until a method is called,
    so train_fn can create its strategy / `stratkit.Trainer` first, as
    multi-worker TensorFlow requires.

    Typical use in train_fn::

        trainer = stratkit.Trainer()
        model = trainer.build(build_and_compile)
        global_batch = 32 * trainer.num_replicas
        trainer.fit(model, data.dataset_fn(global_batch),
                    steps_per_epoch=data.steps_per_epoch(global_batch, trainer.num_replicas), epochs=5)
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

    # -- reading --------------------------------------------------------------------------------
    def _columns(self) -> list[str]:
        cols = list(self.staged.feature_cols)
        if self.staged.label_col is not None:
            cols.append(self.staged.label_col)
        return cols

    def iter_batches(self, batch_rows: int = 4096) -> Iterator[tuple[Any, Any]]:
        """This shard's rows as `(x, y)` numpy batches in file order (`y` is None without a label)."""
        import pyarrow.parquet as pq

        offset = 0
        stores: dict[str, storage.Store] = {}
        for uri, rows in self.staged.files:
            lo, hi = max(self.start, offset), min(self.stop, offset + rows)
            if lo < hi:
                parent, name = uri.rstrip("/").rsplit("/", 1)
                if parent not in stores:
                    stores[parent] = storage.open_store(parent, "the staged DataFrame")
                with stores[parent].open(name) as handle:
                    yield from self._read_range(pq.ParquetFile(handle), lo - offset, hi - offset, batch_rows)
            offset += rows
            if offset >= self.stop:
                break

    def _read_range(self, parquet: Any, lo: int, hi: int, batch_rows: int) -> Iterator[tuple[Any, Any]]:
        groups, first_row, position = [], None, 0
        for i in range(parquet.metadata.num_row_groups):
            n = parquet.metadata.row_group(i).num_rows
            if position + n > lo and position < hi:
                groups.append(i)
                first_row = position if first_row is None else first_row
            position += n
        if not groups:
            return
        row = first_row
        for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=groups, columns=self._columns()):
            a, b = max(lo - row, 0), min(hi - row, batch.num_rows)
            if a < b:
                yield self._to_numpy(batch.slice(a, b - a))
            row += batch.num_rows
            if row >= hi:
                break

    def _to_numpy(self, batch: Any) -> tuple[Any, Any]:
        import numpy as np

        parts = [_column_matrix(batch.column(batch.schema.get_field_index(c)), c) for c in self.staged.feature_cols]
        x = np.concatenate(parts, axis=1).astype(self.staged.feature_dtype, copy=False)
        y = None
        if self.staged.label_col is not None:
            column = batch.column(batch.schema.get_field_index(self.staged.label_col))
            y = _column_matrix(column, self.staged.label_col)
            y = y[:, 0] if y.shape[1] == 1 and not _is_list(column.type) else y.astype("float32")
        return x, y

    def column_widths(self) -> dict[str, int]:
        """Values per row of each staged column (1 for a scalar), from the first row: the feature matrix of
        `iter_batches` is the feature columns' values side by side, in `feature_cols` order."""
        import pyarrow.parquet as pq

        for uri, rows in self.staged.files:
            if rows:
                parent, name = uri.rstrip("/").rsplit("/", 1)
                with storage.open_store(parent, "the staged DataFrame").open(name) as handle:
                    batch = next(pq.ParquetFile(handle).iter_batches(batch_size=1, columns=self._columns()))
                return {column: _column_matrix(batch.column(batch.schema.get_field_index(column)), column).shape[1]
                        for column in self._columns()}
        raise ConfigError("the staged DataFrame has no rows")

    def to_numpy(self) -> tuple[Any, Any]:
        """The whole shard in memory as `(x, y)` numpy arrays."""
        import numpy as np

        xs, ys = [], []
        for x, y in self.iter_batches():
            xs.append(x)
            ys.append(y)
        if not xs:
            raise ConfigError(f"shard {self.index} of {self.count} has no rows")
        return np.concatenate(xs), (np.concatenate(ys) if ys[0] is not None else None)

    def _signature(self) -> Any:
        import tensorflow as tf

        x, y = next(self.iter_batches(batch_rows=1))
        x_spec = tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype))
        if y is None:
            return x_spec
        return x_spec, tf.TensorSpec((None,) + y.shape[1:], tf.as_dtype(y.dtype))

    def dataset(self) -> Any:
        """This shard as an unbatched `tf.data.Dataset` of `(x, y)` (or `x`), in file order.

        Auto-sharding is OFF on it: the rows are already this worker's share.
        For `model.fit` under a multi-worker strategy, prefer `dataset_fn`,
        which also keeps the step count equal on every worker.
        """
        import tensorflow as tf

        labeled = self.staged.label_col is not None

        def generate() -> Iterator[Any]:
            for x, y in self.iter_batches():
                yield (x, y) if labeled else x

        dataset = tf.data.Dataset.from_generator(generate, output_signature=self._signature()).unbatch()
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
                   shuffle_buffer: int = 10_000) -> Any:
        """A `dataset_fn(input_context)` for `Trainer.fit` / `strategy.distribute_datasets_from_function`.

        Each pass yields exactly `steps_per_epoch` batches per replica from this
        worker's rows (reshuffled every pass when `shuffle`), then repeats, so
        Keras' `steps_per_epoch` epochs line up with passes over the data.
        """

        def fn(input_context: Any) -> Any:
            import tensorflow as tf

            if input_context.num_input_pipelines != self.count:
                raise ConfigError(f"the strategy has {input_context.num_input_pipelines} input pipeline(s) but the "
                                  f"DataFrame was split for {self.count} workers. Fix: use the strategy "
                                  "stratkit.Trainer()/make_strategy() builds on the Spark runner's cluster")
            replicas = input_context.num_replicas_in_sync
            per_replica = self._per_replica(global_batch_size, replicas)
            steps = self.steps_per_epoch(global_batch_size, replicas)
            dataset = self.dataset()
            if shuffle:
                dataset = dataset.shuffle(max(1, min(self.num_rows, shuffle_buffer)), seed=seed + self.index,
                                          reshuffle_each_iteration=True)
            local = replicas // self.count
            dataset = dataset.batch(per_replica).take(steps * local).repeat()
            return dataset.prefetch(tf.data.AUTOTUNE)

        return fn

    def __repr__(self) -> str:
        return (f"ParquetShard(index={self.index}, count={self.count}, rows={self.num_rows} of {self.total_rows}, "
                f"features={list(self.staged.feature_cols)}, label={self.staged.label_col!r})")


def _is_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


def _column_matrix(column: Any, name: str) -> Any:
    """An Arrow column as a 2-D numpy array: scalars as (n, 1), equal-length number arrays as (n, d)."""
    import numpy as np
    import pyarrow.compute as pc

    n = len(column)
    if column.null_count:
        raise ConfigError(f"column {name!r} has {column.null_count} null value(s) in a batch. Fix: fill or drop "
                          "them before training (df.na.fill / df.na.drop)")
    if not _is_list(column.type):
        return np.asarray(column.to_numpy(zero_copy_only=False)).reshape(n, 1)
    lengths = pc.list_value_length(column)
    low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if n and low != high:
        raise ConfigError(f"column {name!r} holds arrays of different lengths ({low} to {high}). Fix: pad or trim "
                          "them to one length before training")
    values = column.flatten()
    if values.null_count:
        raise ConfigError(f"column {name!r} has null elements inside its arrays. Fix: fill them before training")
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(n, low or 0)
