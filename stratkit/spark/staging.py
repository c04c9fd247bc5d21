"""A DataFrame argument staged as Parquet where every training task can read it: written by the executors.

`stage` selects the DataFrame's feature and label columns and has the
executors write them as Parquet (`mapInArrow`: pyarrow, no Hadoop connector)
through the store layer (`stratkit.storage`), one file per partition, each
uploaded whole: a local directory, a shared mount, or a store URL (s3://,
gs://, az://, hdfs://) from `staging_dir=` or the conf
`spark.stratkit.stagingDir`. Spark's own Parquet writer would need Hadoop's
S3A/GCS/ABFS connector jars on every executor for a store URL; pyarrow and
fsspec need only what the Python side already has. The executors report each
file's name and row count, which is the file table every task gets
(`stratkit.spark.data.StagedData`): no footer is read again, no data travels
through the Spark closure. Each column is written in its own type (int64,
float64, strings, arrays; a Spark ML vector as an array of float64: what
`spark_column` says it holds, a type that feeds no model refused before the
job), and the executors also report each numeric column's smallest and largest
value, against which a task checks its model's casts before reading a row.

The driver probes the store before the job (a missing bucket or refused
credentials are a `ConfigError` before any task runs); an executor that
cannot write (its own credentials or endpoint missing) sends its error back,
and the driver raises one `ConfigError` naming the executors' environment as
the fix. Files of a retried task attempt that lost carry another attempt
number and are not in the table; they go with the run's directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Any

from stratkit import storage
from stratkit.data.columns import Column, column_of
from stratkit.errors import ConfigError
from stratkit.spark.data import DataFrameInput, StagedData

log = logging.getLogger(__name__)

STAGING_CONF = "spark.stratkit.stagingDir"
#: What the executors send back for each partition: its file and rows (and each numeric column's smallest and
#: largest value, JSON), or why it could not be written.
_REPORT = "name string, rows long, error string, stats string"


def _is_local_master(master: str) -> bool:
    return master == "local" or master.startswith(("local[", "local-cluster["))


def _column_expression(df: Any, name: str, vector_dtype: str = "float64") -> Any:
    """The column as Arrow carries it in its own type (`spark_column` checked it), a Spark ML vector as an array of
    `vector_dtype`."""
    from pyspark.sql import functions as F

    spark_column(df.schema[name])
    if _is_vector(df.schema[name].dataType):
        from pyspark.ml.functions import vector_to_array

        return vector_to_array(F.col(name), vector_dtype).alias(name)
    return F.col(name)


def _is_vector(field_type: Any) -> bool:
    return field_type.typeName() in ("vector", "vectorudt") or type(field_type).__name__ == "VectorUDT"


def spark_column(field: Any) -> Column:
    """What a DataFrame column (a `StructField`) holds, as `stratkit.data.columns` describes a column: its values'
    dtype and per-row shape (a Spark ML vector: float64 of its size from its ML attribute metadata, which
    VectorAssembler, StandardScaler, ... write; an array's length is known at its first row).

    Raises:
        ConfigError: a type that feeds no model (timestamps, structs, maps, ...), naming the column and the fix.
    """
    if _is_vector(field.dataType):
        attributes = (field.metadata or {}).get("ml_attr", {})
        width = attributes.get("num_attrs")
        if width is None:
            groups = attributes.get("attrs", {})
            width = sum(len(group) for group in groups.values()) if isinstance(groups, dict) else 0
        return Column(field.name, "float64", (int(width) if width else None,))
    return column_of(field.name, _arrow_type(field.dataType))


def _arrow_type(spark_type: Any) -> Any:
    """The Arrow type Spark hands a column's values over in (what `mapInArrow` and the Arrow UDFs see)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type

    try:
        return to_arrow_type(spark_type, timezone="UTC")
    except Exception:  # noqa: BLE001 - a type Arrow cannot carry: column_of refuses it, naming the column
        return pa.string() if spark_type.typeName() in ("varchar", "char") else pa.null()


def _min_max(array: Any) -> tuple[Any, Any] | None:
    """The smallest and largest value of a numeric Arrow column (its arrays' values, flattened); None for strings,
    booleans and an empty or all-null column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or \
            pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or
            pa.types.is_decimal(array.type)):
        return None
    found = pc.min_max(array).as_py()
    if found["min"] is None:
        return None
    low, high = found["min"], found["max"]
    if pa.types.is_decimal(array.type):  # as columns.column_of reads it: int64 without a scale, else float64
        low, high = (int(low), int(high)) if array.type.scale == 0 else (float(low), float(high))
    return low, high


def _merge(stats: dict[str, list[Any]], batch: Any) -> None:
    for name in batch.schema.names:
        found = _min_max(batch.column(name))
        if found is not None:
            low, high = stats.get(name, found)
            stats[name] = [min(low, found[0]), max(high, found[1])]


def _part_writer(path: str) -> Any:
    """The `mapInArrow` function that writes one partition to `path` (a directory or URL) as one Parquet file."""

    def write(batches: Any) -> Any:
        import json
        import os

        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        context = TaskContext.get()
        name = f"part-{context.partitionId():05d}-a{context.attemptNumber()}.parquet"
        scratch = tempfile.mkdtemp(prefix="stratkit-staging-part-")
        rows, error, writer, stats = 0, "", None, {}
        try:
            local = os.path.join(scratch, name)
            for batch in batches:
                if batch.num_rows:
                    writer = writer or pq.ParquetWriter(local, batch.schema)
                    writer.write_batch(batch)
                    rows += batch.num_rows
                    _merge(stats, batch)
            if writer is not None:
                writer.close()
                storage.open_store(path, "staging_dir").upload(local, name)
        except (OSError, ConfigError) as exc:   # the store refused or cannot be reached from this executor
            error = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        yield pa.RecordBatch.from_pydict({"name": [name if rows else ""], "rows": [rows], "error": [error],
                                          "stats": [json.dumps(stats)]},
                                         schema=pa.schema([("name", pa.string()), ("rows", pa.int64()),
                                                           ("error", pa.string()), ("stats", pa.string())]))

    return write


def stage(data: DataFrameInput, spark: Any, run_id: str, name: str, num_shards: int) -> StagedData:
    """Write `data`'s columns as Parquet under `<staging dir>/<run_id>/<name>` (by the executors); the file table.

    Raises:
        ConfigError: no staging directory on a cluster master, a store that cannot be written (from the
            driver or from an executor), a column that cannot become a tensor, fewer rows than `num_shards`.
    """
    master = str(spark.conf.get("spark.master", ""))
    root = data.staging_dir or spark.conf.get(STAGING_CONF, None)
    owned = root is None
    if root is None:
        if not _is_local_master(master):
            raise ConfigError(f"a DataFrame argument must be staged where every executor can read it, but no "
                              f"staging directory is set (spark.master={master!r}). Fix: pass "
                              f"DataFrameInput(df, staging_dir='s3://bucket/stratkit-staging') (or gs://, az://, "
                              f"hdfs://, a shared mount), or set the conf {STAGING_CONF}")
        root = tempfile.mkdtemp(prefix="stratkit-staging-")
    root = str(root)
    path = storage.join(root, run_id, name)
    storage.check_store(path, "staging_dir")     # a URL: probed here, before any job runs
    expressions = [_column_expression(data.df, c) for c in data.columns]   # each column in its own type
    reports = data.df.select(*expressions).mapInArrow(_part_writer(path), _REPORT).collect()
    staged = StagedData(path=path if not owned else root,
                        files=tuple(sorted((storage.join(path, r["name"]), int(r["rows"])) for r in reports
                                           if r["rows"])),
                        feature_cols=tuple(data.feature_cols),
                        label_col=data.label_col if not isinstance(data.label_col, list) else tuple(data.label_col),
                        weight_col=data.weight_col, feature_dtype=data.feature_dtype,
                        stats=_gathered([r["stats"] for r in reports if r["rows"]]), owned=owned)
    errors = sorted({r["error"] for r in reports if r["error"]})
    if errors:
        remove(staged)
        raise ConfigError(f"staging_dir={storage.redact(root)!r}: the executors could not write the staged "
                          f"Parquet ({errors[0]}). Fix: give every executor this store's credentials and endpoint "
                          "(the cluster's environment, or spark.executorEnv.* / the session's environment), or "
                          "stage on storage they can write")
    if staged.num_rows < num_shards:
        remove(staged)
        raise ConfigError(f"the DataFrame for {name!r} has {staged.num_rows} row(s), fewer than the {num_shards} "
                          "training workers (each needs at least one). Fix: pass more rows or fewer workers")
    return staged


def _gathered(reports: list[str]) -> tuple[tuple[str, Any, Any], ...]:
    """Every partition's min/max merged: (column, smallest, largest) per numeric column."""
    import json

    merged: dict[str, list[Any]] = {}
    for text in reports:
        for name, (low, high) in json.loads(text or "{}").items():
            old = merged.get(name, [low, high])
            merged[name] = [min(old[0], low), max(old[1], high)]
    return tuple((name, low, high) for name, (low, high) in sorted(merged.items()))


def remove(staged: StagedData) -> None:
    """Delete what the run staged (a directory the runner created whole; in a user's directory, the run's part)."""
    if staged.owned:
        shutil.rmtree(staged.path, ignore_errors=True)
        return
    try:
        store = storage.open_store(staged.path, "staging_dir")
        store.remove_all()
        if store.local:       # `<run id>/<name>` on a disk: the run's own directory goes with its last argument
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(os.path.normpath(store.path())))
    except Exception as exc:  # noqa: BLE001 - best effort: the run's result matters more than its scratch
        log.warning("could not remove the staging directory %s: %s", storage.redact(staged.path), exc)


__all__ = ["STAGING_CONF", "remove", "spark_column", "stage"]
