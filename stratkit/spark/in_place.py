"""Spark: whether a training argument is read in place by every worker, or staged as a Parquet copy first.

The one decision `SparkRunner.run` (and through it `KerasEstimator.fit`) asks for each argument:

* a `stratkit.data.TableInput` is read in place: planned once on the driver (the listing and the footers; a
  Delta table pinned to its latest version), so a bad table is a `ConfigError` before any Spark job, and shipped
  to the tasks as that small plan; each worker's `Trainer.fit` reads its own lanes from the store;
* a `DataFrameInput(df, in_place=None)` (`KerasEstimator`'s default) whose DataFrame is exactly a scan of a
  Parquet table -- its optimized plan a bare file
  relation, or a projection of some of its columns (no alias, cast, filter, sample, limit, repartition, join or
  anything else Spark would compute), every column the type staging would give it, the files Spark would read
  the ones stratkit lists -- becomes such a `TableInput` (its path, its columns) and is read in place too:
  no staging copy, no staging directory. train_fn then receives that `TableInput` (a `ScannedTable`, which also
  takes a `ParquetShard`'s `dataset_fn(G, model=model)` / `steps_per_epoch(G, replicas)`) for `Trainer.fit`;
* everything else is staged (`stratkit.spark.staging`): what Spark computes only Spark can write.
  `DataFrameInput(df)` (in_place=False, the default) and a bare DataFrame stage a scan too (train_fn keeps its
  `ParquetShard` and every method of it); `in_place=True` refuses a DataFrame that cannot be read in place,
  saying why.

Detection reads the analyzed plan through the JVM (`df._jdf`); a DataFrame without one (Spark Connect) is
staged. Delta tables read by Spark (delta-spark) are not detected: pass `TableInput(Table.delta(url))`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from stratkit import status
from stratkit.data import Table, TableInput
from stratkit.data.table_input import planned
from stratkit.errors import ConfigError
from stratkit.spark.data import DataFrameInput

log = status.logger(__name__)

#: Spark's URL schemes -> the store layer's (what `Table.parquet` reads); any other scheme is staged.
_SCHEMES = {"file": "", "s3a": "s3", "s3n": "s3", "s3": "s3", "gs": "gs", "hdfs": "hdfs"}
_RELATION = "org.apache.spark.sql.execution.datasources.LogicalRelation"
_PROJECT = "org.apache.spark.sql.catalyst.plans.logical.Project"
_ATTRIBUTE = "org.apache.spark.sql.catalyst.expressions.AttributeReference"


def read_in_place(value: Any, spark: Any, name: str) -> TableInput | None:
    """The `TableInput` an argument is read in place as, or None when it must be staged (see the module docstring).

    Args:
        value: a `TableInput`, a `DataFrameInput` (its `in_place` says), or anything else (None).
        spark: the session (for the file listing's comparison, nothing is read).
        name: the argument's name, for messages.

    Raises:
        ConfigError: a table that cannot be planned; `in_place=True` on a DataFrame Spark computes.
    """
    if isinstance(value, TableInput):
        return planned(value)
    if not isinstance(value, DataFrameInput) or value.in_place is False:
        return None
    table, why = _scanned_table(value)
    what, opt_out, forced = value.described
    what = what.format(name=name)
    if table is None:
        if value.in_place:
            raise ConfigError(f"{what}: {forced}, but the DataFrame is not a plain scan of a Parquet table ({why}). "
                              f"Fix: {opt_out} (stage it) or pass TableInput(Table.parquet(url), ...)")
        log.debug("%s is staged: %s", what, why)
        return None
    data = ScannedTable(table, features=list(value.feature_cols),
                        label=value.label_cols[0] if value.label_cols else None, sample_weight=value.weight_col)
    log.info("%s is a scan of the Parquet table %s: read in place by every worker (no staging copy). %s stages it",
             what, table.shown, opt_out)
    return data


class ScannedTable(TableInput):
    """A DataFrame argument read in place: a `TableInput` (pass it to `Trainer.fit` with `global_batch_size=`), which
    also takes the `ParquetShard` calls a train_fn written for a staged DataFrame makes:
    `trainer.fit(model, data.dataset_fn(G, model=model), steps_per_epoch=data.steps_per_epoch(G, replicas))` trains
    each row once per epoch (an epoch is one pass: ceil(rows / G) steps, the last batch partial). The shard's other
    methods are refused with the fix."""

    def steps_per_epoch(self, global_batch_size: int, num_replicas: int | None = None) -> int:
        """Global batches in one pass (`num_replicas`, which a `ParquetShard` takes, changes nothing here)."""
        return super().steps_per_epoch(global_batch_size)

    def dataset_fn(self, global_batch_size: int, shuffle: bool = True, seed: int | None = None,
                   shuffle_buffer: int | None = None, model: Any = None, **kwargs: Any) -> Any:
        """`TableInput.dataset_fn`, with `ParquetShard.dataset_fn`'s `shuffle` and `seed` (`shuffle_buffer` has no
        meaning here: the table's order shuffles in windows)."""
        data = self if shuffle and seed is None else self._copy(
            seed=self.seed if seed is None else int(seed), seed_given=True, shuffle=self.shuffle and shuffle)
        return TableInput.dataset_fn(data, global_batch_size, model, **kwargs)

    def table_input(self, *, seed: int | None = None, shuffle: bool = True, **options: Any) -> TableInput:
        """`ParquetShard.table_input`'s counterpart: this table as a `TableInput` (itself, unless settings are
        given), so a train_fn that fits `data.table_input()` runs on a staged DataFrame and on one read in place."""
        if seed is None and shuffle and not options:
            return self
        return TableInput(self.table, features=self.features, label=self.label, sample_weight=self.sample_weight,
                          seed=seed, shuffle=shuffle, **options)

    def __getattr__(self, name: str) -> Any:
        if name in _SHARD_ONLY:
            raise ConfigError(f"{name}() is a ParquetShard method: this DataFrame is a plain Parquet scan, read in "
                              "place as a stratkit.data.TableInput. Fix: pass it to trainer.fit(model, data, "
                              "global_batch_size=G), or stage it with DataFrameInput(df, in_place=False)")
        raise AttributeError(name)


#: `ParquetShard`'s methods a `ScannedTable` has no counterpart of.
_SHARD_ONLY = frozenset({"shard_sizes", "record_batches", "schema", "dataset", "iter_batches", "to_numpy",
                         "total_rows", "index", "count", "staged"})


def _scanned_table(data: DataFrameInput) -> tuple[Table | None, str]:
    """(the planned Parquet table the DataFrame scans, "") or (None, why it is not one)."""
    if len(data.label_cols) > 1:
        return None, "several label columns (a TableInput takes one)"
    if data.feature_dtype is not None:
        return None, "feature_dtype is set (the staged one-matrix batches)"
    root, why = _scan_root(data.df)
    if root is None:
        return None, why
    try:
        table = Table.parquet(root, columns=list(data.columns))
        plan = table.plan()
        files = {_bare(path) for path in plan.files}
        spark_files = {_bare(f) for f in data.df.inputFiles()}
    except ConfigError as exc:   # stratkit cannot read it as Spark does (e.g. a schema Spark merges): staged
        return None, f"stratkit cannot plan it ({exc})"
    if files != spark_files:
        return None, (f"Spark reads {len(spark_files)} file(s), stratkit lists {len(files)} under {root} (a path "
                      "filter or listing option)")
    from stratkit.spark.staging import spark_column

    for column in data.columns:
        spark_dtype = spark_column(data.df.schema[column]).dtype
        if spark_dtype != plan.column(column).dtype:
            return None, (f"column {column!r} is {spark_dtype} in the DataFrame but {plan.column(column).dtype} in "
                          "the files")
    return table, ""


def _scan_root(df: Any) -> tuple[str | None, str]:
    """(the table's root as the store layer names it, "") when `df`'s optimized plan is a Parquet file relation or a
    plain projection of one; else (None, why)."""
    try:
        node = df._jdf.queryExecution().optimizedPlan()
    except Exception as exc:  # noqa: BLE001 - Spark Connect, or a plan that fails to analyse: staged as before
        return None, f"its plan cannot be read ({type(exc).__name__})"
    kind = node.getClass().getName()
    if kind == _PROJECT:
        projected = node.projectList()
        for i in range(projected.size()):
            if projected.apply(i).getClass().getName() != _ATTRIBUTE:
                return None, "it computes a column"
        node = node.child()
        kind = node.getClass().getName()
    if kind != _RELATION:
        return None, f"Spark computes it ({kind.rsplit('.', 1)[-1]})"
    relation = node.relation()
    fmt = relation.getClass().getName().endswith("HadoopFsRelation") and \
        relation.fileFormat().getClass().getName().rsplit(".", 1)[-1]
    if fmt != "ParquetFileFormat":
        return None, f"not a Parquet scan ({fmt or relation.getClass().getName()})"
    roots = relation.location().rootPaths()
    if roots.size() != 1:
        return None, f"{roots.size()} root paths"
    return _store_url(roots.apply(0).toString())


def _store_url(uri: str) -> tuple[str | None, str]:
    parts = urlsplit(uri)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None:
        return None, f"a {parts.scheme}:// path the store layer does not read as Spark does"
    path = unquote(parts.path)
    return (path if not scheme else f"{scheme}://{parts.netloc}{path}"), ""


def _bare(uri: str) -> str:
    """A file's location without its scheme (Spark's `file:/`, `s3a://` and the store layer's spellings alike)."""
    parts = urlsplit(uri)
    return (parts.netloc + unquote(parts.path)).rstrip("/") if parts.scheme else unquote(uri).rstrip("/")


__all__ = ["ScannedTable", "planned", "read_in_place"]
