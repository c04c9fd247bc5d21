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
through the Spark closure.

The driver probes the store before the job (a missing bucket or refused
credentials are a `ConfigError` before any task runs); an executor that
cannot write (its own credentials or endpoint missing) sends its error back,
and the driver raises one `ConfigError` naming the executors' environment as
the fix. Files of a retried task attempt that lost carry another attempt
number and are not in the table; they go with the run's directory.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.spark.data import DataFrameInput, StagedData

log = logging.getLogger(__name__)

STAGING_CONF = "spark.stratkit.stagingDir"
_NUMERIC = ("byte", "short", "integer", "long", "float", "double", "decimal", "boolean")
#: What the executors send back for each partition: its file and rows, or why it could not be written.
_REPORT = "name string, rows long, error string"


def _is_local_master(master: str) -> bool:
    return master == "local" or master.startswith(("local[", "local-cluster["))


def _column_expression(df: Any, name: str, vector_dtype: str = "float64") -> Any:
    """The column as something Arrow carries as numbers (a Spark ML vector as an array of `vector_dtype`)."""
    from pyspark.sql import functions as F

    field_type = df.schema[name].dataType
    type_name = field_type.typeName()
    if _is_vector(field_type):
        from pyspark.ml.functions import vector_to_array

        return vector_to_array(F.col(name), vector_dtype).alias(name)
    if type_name in _NUMERIC:
        return F.col(name).cast("double").alias(name) if type_name in ("decimal", "boolean") else F.col(name)
    if type_name == "array" and field_type.elementType.typeName() in _NUMERIC:
        return F.col(name)
    raise ConfigError(f"column {name!r} has type {field_type.simpleString()}, which cannot become a tensor. Fix: "
                      "use numeric columns, arrays of numbers or Spark ML vectors (e.g. assemble them with "
                      "pyspark.ml.feature.VectorAssembler), or leave the column out of feature_cols")


def _is_vector(field_type: Any) -> bool:
    return field_type.typeName() in ("vector", "vectorudt") or type(field_type).__name__ == "VectorUDT"


def column_width(field: Any) -> int | None:
    """Values per row of a DataFrame column (a `StructField`) as its schema tells: 1 for a number, a Spark ML
    vector's size from its ML attribute metadata (VectorAssembler, StandardScaler, ... write it), else None
    (an array column, or a vector without that metadata: known at its first row)."""
    if _is_vector(field.dataType):
        attributes = (field.metadata or {}).get("ml_attr", {})
        if "num_attrs" in attributes:
            return int(attributes["num_attrs"])
        groups = attributes.get("attrs", {})
        count = sum(len(group) for group in groups.values()) if isinstance(groups, dict) else 0
        return count or None
    return 1 if field.dataType.typeName() in _NUMERIC else None


def _part_writer(path: str) -> Any:
    """The `mapInArrow` function that writes one partition to `path` (a directory or URL) as one Parquet file."""

    def write(batches: Any) -> Any:
        import os

        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        context = TaskContext.get()
        name = f"part-{context.partitionId():05d}-a{context.attemptNumber()}.parquet"
        scratch = tempfile.mkdtemp(prefix="stratkit-staging-part-")
        rows, error, writer = 0, "", None
        try:
            local = os.path.join(scratch, name)
            for batch in batches:
                if batch.num_rows:
                    writer = writer or pq.ParquetWriter(local, batch.schema)
                    writer.write_batch(batch)
                    rows += batch.num_rows
            if writer is not None:
                writer.close()
                storage.open_store(path, "staging_dir").upload(local, name)
        except (OSError, ConfigError) as exc:   # the store refused or cannot be reached from this executor
            error = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        yield pa.RecordBatch.from_pydict({"name": [name if rows else ""], "rows": [rows], "error": [error]},
                                         schema=pa.schema([("name", pa.string()), ("rows", pa.int64()),
                                                           ("error", pa.string())]))

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
    columns = [_column_expression(data.df, c) for c in data.feature_cols]
    if data.label_col is not None:
        columns.append(_column_expression(data.df, data.label_col))
    reports = data.df.select(*columns).mapInArrow(_part_writer(path), _REPORT).collect()
    staged = StagedData(path=path if not owned else root,
                        files=tuple(sorted((storage.join(path, r["name"]), int(r["rows"])) for r in reports
                                           if r["rows"])),
                        feature_cols=tuple(data.feature_cols), label_col=data.label_col,
                        feature_dtype=data.feature_dtype, owned=owned)
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


def remove(staged: StagedData) -> None:
    """Delete what the run staged (a directory the runner created whole; in a user's directory, the run's part)."""
    if staged.owned:
        shutil.rmtree(staged.path, ignore_errors=True)
        return
    try:
        storage.open_store(staged.path, "staging_dir").remove_all()
    except Exception as exc:  # noqa: BLE001 - best effort: the run's result matters more than its scratch
        log.warning("could not remove the staging directory %s: %s", storage.redact(staged.path), exc)


__all__ = ["STAGING_CONF", "remove", "stage"]
