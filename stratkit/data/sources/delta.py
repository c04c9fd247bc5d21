"""A Delta table read with `deltalake` (delta-rs): one version's files, partition values and deletion vectors.

The version is pinned when `fit` starts (the table's latest, agreed by every worker: the chief's) or given
(`version=` a number, or a timestamp: the version current then), and recorded in the backups, so a resume
reads that version after the table has new commits (Delta keeps them until VACUUM). The files of the version
are then read as Parquet (`sources.parquet`), row group by row group, like any Parquet table:

* partition values come from the log, typed by the table's schema;
* deletion vectors are applied: delta-rs gives each affected file's keep-mask, a unit's rows are the rows
  it keeps, and the reader drops the others;
* a table with column mapping (`delta.columnMapping.mode` name or id: the files' column names are not the
  table's) is refused with the fix, as is a version that does not exist.

Credentials and endpoints: delta-rs reads the store's usual environment (`AWS_*`, `AZURE_STORAGE_*`,
`GOOGLE_*`); an `http://` S3 endpoint (a test store, MinIO) is allowed when `AWS_ENDPOINT_URL` names one.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any

from stratkit.errors import ConfigError

_INTS = ("byte", "short", "integer", "long")


def storage_options(url: str) -> dict[str, str]:
    """delta-rs options the environment implies (an http S3 endpoint must be allowed explicitly)."""
    options: dict[str, str] = {}
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        options.setdefault("AWS_REGION", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                           or "us-east-1")
        options["AWS_S3_ALLOW_UNSAFE_RENAME"] = "true"  # reading only: no locking provider needed
    return options


def _import() -> Any:
    try:
        import deltalake
    except ImportError:
        raise ConfigError("reading a Delta table needs the deltalake package (delta-rs). Fix: pip install "
                          "\"stratkit[lake]\" (or pip install deltalake) on every machine of the cluster") from None
    return deltalake


def open_table(url: str, version: Any, shown: str) -> Any:
    """The `deltalake.DeltaTable` at `version` (None: the latest; an int; a datetime or an ISO 8601 string).

    Raises:
        ConfigError: no Delta table there, or no such version (naming the versions there are).
    """
    deltalake = _import()
    options = storage_options(url)
    try:
        table = deltalake.DeltaTable(url, storage_options=options or None)
    except Exception as exc:  # noqa: BLE001 - delta-rs raises TableNotFoundError / OSError / its own
        raise ConfigError(f"{shown!r} is not a Delta table that can be read ({type(exc).__name__}: {exc}). Fix: "
                          "point Table.delta at the table's root (the directory holding _delta_log), or use "
                          "Table.parquet for plain Parquet files") from None
    if version is None:
        return table
    latest = table.version()
    if isinstance(version, str) and version.strip().isdigit():   # "3" from a config file or a command line
        version = int(version.strip())
    try:
        if isinstance(version, bool):
            raise TypeError
        if isinstance(version, int):
            if not 0 <= version <= latest:
                raise ValueError(f"version {version} does not exist")
            table.load_as_version(version)
        elif isinstance(version, (str, _dt.datetime)):
            table.load_as_version(moment(version))
        else:
            raise TypeError
    except TypeError:
        raise ConfigError(f"version={version!r} for the Delta table {shown!r} is not a version number, a datetime "
                          "or an ISO 8601 string. Fix: e.g. version=3 or version='2024-05-01T00:00:00Z'") from None
    except Exception as exc:  # noqa: BLE001 - delta-rs: no such version / timestamp before the table
        raise ConfigError(f"the Delta table {shown!r} has no version {version!r} (its versions: 0 to {latest}; "
                          f"{type(exc).__name__}: {exc}). Fix: pass a version in that range (or a timestamp after "
                          "the table was created), or leave version= out to read the latest") from None
    if not isinstance(version, int):
        _check_not_before_creation(table, version, shown, latest)
    return table


def moment(when: str | _dt.datetime) -> _dt.datetime:
    """A `version=` timestamp as an aware datetime: an ISO 8601 string ('2024-05-01', '2024-05-01T12:00:00Z',
    '...+02:00') or a datetime; without an offset it is UTC, as delta-rs takes a naive datetime (delta-rs itself
    parses RFC 3339 strings only, so '2024-05-01' failed there).

    Raises:
        TypeError: a string that is not ISO 8601 (the caller names it and the fix).
    """
    if isinstance(when, str):
        text = when.strip()
        try:   # Python 3.10's fromisoformat takes no "Z"
            when = _dt.datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text)
        except ValueError:
            raise TypeError(f"{when!r} is not ISO 8601") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=_dt.timezone.utc)


def _check_not_before_creation(table: Any, when: Any, shown: str, latest: int) -> None:
    """Refuse a timestamp before the table's earliest commit: delta-rs reads that version for it (1.6.6,
    measured), which the table did not hold at that time. A timestamp after the last commit reads the last version, as
    "the table as of then" does (`fit` pins and records it)."""
    try:
        first = min(int(entry["timestamp"]) for entry in table.history() if entry.get("timestamp") is not None)
    except (ValueError, TypeError, KeyError):  # no history with timestamps: delta-rs's answer stands
        return
    created = _dt.datetime.fromtimestamp(first / 1000, _dt.timezone.utc)
    if moment(when) < created:
        raise ConfigError(f"version={when!r} is before the earliest commit the Delta table {shown!r} holds "
                          f"({created.isoformat()}): no version of it can be read as of then. Fix: pass a timestamp "
                          f"at or after that, a version number (0 to {latest}), or leave version= out to read the "
                          "latest")


def snapshot(table: Any, url: str, shown: str, columns: Any) -> dict[str, Any]:
    """What the plan needs of a pinned version: files (relative paths, sizes), partition values, masks, schema."""
    import numpy as np
    import pyarrow as pa

    config = dict(table.metadata().configuration or {})
    mode = config.get("delta.columnMapping.mode", "none")
    if mode not in ("none", None, ""):
        raise ConfigError(f"the Delta table {shown!r} uses column mapping (delta.columnMapping.mode={mode}): its "
                          "files name their columns differently from the table, which this reader does not "
                          "translate. Fix: read it through Spark (DataFrameInput), or rewrite it without column "
                          "mapping")
    actions = pa.table(table.get_add_actions(flatten=True))
    schema = pa.schema(table.schema().to_arrow())
    partition_columns = list(table.metadata().partition_columns)
    types = {name: _partition_dtype(schema.field(name).type) for name in partition_columns}
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    values = []
    for i in range(len(paths)):
        row = {}
        for name in partition_columns:
            raw = actions.column(f"partition.{name}")[i].as_py()
            if raw is None:   # refused only if read (`parquet.plan_files`); a filter's comparisons with it are false
                row[name] = None
                continue
            row[name] = int(raw) if types[name] == "int64" else (float(raw) if types[name] == "float64" else
                                                                   str(raw))
        values.append(row)
    masks: dict[str, Any] = {}
    try:
        reader = table.deletion_vectors()
        for batch in pa.RecordBatchReader.from_stream(reader):
            for uri, keep in zip(batch.column("filepath").to_pylist(), batch.column("selection_vector").to_pylist()):
                masks[uri] = np.asarray(keep, bool)
    except AttributeError:
        pass
    return {"version": int(table.version()), "paths": paths, "sizes": sizes, "partitions": values,
            "partition_types": types, "masks": masks, "schema": schema, "uris": table.file_uris()}


def _partition_dtype(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_integer(arrow_type):
        return "int64"
    if pa.types.is_floating(arrow_type):
        return "float64"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    raise ConfigError(f"a Delta partition column of type {arrow_type} cannot feed a model. Fix: leave it out of "
                      "the features and label")


__all__ = ["open_table", "snapshot", "storage_options"]
