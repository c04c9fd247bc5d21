"""Parquet files: their plan from the footers (read in parallel), and a unit's rows read back.

Planning reads each file's footer once (one ranged read per file, in `FOOTER_THREADS` threads): its row
groups (the units) with their rows and sizes, its schema, and its column statistics. Before any training:

* every file must hold the columns asked for, with one Arrow type for each column in every file (a
  ConfigError names the file, the column and both types);
* a column whose statistics count nulls is refused (naming the column and the file);
* the smallest and largest value of each column (from the statistics) are kept, so a cast the model asks
  for is checked against them (`columns.check_range`) before a row is read.

Reading a unit decodes only the columns asked for, in batches (`ParquetFile.iter_batches` over that one row
group), and stops once the rows asked for are read: a piece that starts inside a row group decodes the rows
before it and drops them (Parquet has no index by row). A Delta deletion vector's keep-mask is applied here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np

from stratkit import status
from stratkit.data.columns import Column, column_of, null_error
from stratkit.data.plan import Piece, Plan
from stratkit.data.sources.files import FileEntry
from stratkit.errors import ConfigError

log = status.logger(__name__)

FOOTER_THREADS = 16


def _footer(fs: Any, entry: FileEntry, shown: str) -> Any:
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(entry.path) as handle:
            return pq.read_metadata(handle)
    except FileNotFoundError:
        raise ConfigError(f"table file {shown!r} was listed but is gone. Fix: do not rewrite the table while a run "
                          "starts (a Delta table keeps its versions)") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable footer is the same ConfigError
        raise ConfigError(f"table file {shown!r} is not a readable Parquet file ({type(exc).__name__}: {exc}). "
                          "Fix: remove it from the table's directory, or list the table's files yourself") from None


def plan_files(*, kind: str, root: str, source: dict[str, Any], fs: Any, entries: Sequence[FileEntry],
               columns: Sequence[str] | None, partitions: Sequence[dict[str, Any]] = (),
               partition_types: dict[str, str] | None = None, deletions: dict[int, np.ndarray] | None = None,
               shown: Any = None) -> Plan:
    """The plan of Parquet `entries` (with each column's (min, max) from the statistics: `Plan.bounds`).

    Args:
        partitions: per file, its partition values (columns the files do not hold).
        partition_types: partition column -> dtype ("int64", "string", ...).
        deletions: file index -> keep mask (bool per raw row) of a Delta deletion vector.
        shown: callable(path) -> the path as messages show it.
    """
    import pyarrow as pa

    shown = shown or (lambda p: p)
    partition_types = dict(partition_types or {})
    with ThreadPoolExecutor(min(FOOTER_THREADS, max(len(entries), 1)), thread_name_prefix="stratkit-footers") as pool:
        footers = list(pool.map(lambda e: _footer(fs, e, shown(e.path)), entries))
    first = footers[0].schema.to_arrow_schema()
    names = list(columns) if columns is not None else \
        [f.name for f in first if f.name not in partition_types] + list(partition_types)
    stored = [n for n in names if n not in partition_types]
    for name in names:
        if name not in partition_types and first.get_field_index(name) < 0:
            raise ConfigError(f"column {name!r} is not in table file {shown(entries[0].path)!r} (its columns: "
                              f"{first.names}; partition columns: {list(partition_types)}). Fix: columns=/features=/"
                              "label= must name columns of the table")
    for name in names:
        if name in partition_types and first.get_field_index(name) >= 0:
            log.warning("column %r is both a partition (the directories %s=...) and a column of table file %r: "
                        "the directory's value is read, the file's column is not. Fix: rename the column in the "
                        "files, or the partition directories, if the two can differ", name, name,
                        shown(entries[0].path))
        if name in partition_types:
            nulls = [entries[i].path for i, values in enumerate(partitions) if values.get(name, "") is None]
            if nulls:
                raise ConfigError(f"partition column {name!r} is null for {len(nulls)} file(s), e.g. "
                                  f"{shown(nulls[0])!r}. Fix: leave {name!r} out of the features, filter those "
                                  f"files out (filter=[({name!r}, '!=', ...)] keeps no null), or fill the partition")
    types = {n: _canonical([md.schema.to_arrow_schema() for md in footers], n) for n in stored}
    fields = [pa.field(n, types[n]) if n in types else pa.field(n, _arrow_type(partition_types[n])) for n in names]
    schema = pa.schema(fields)
    described = tuple(_width(column_of(f.name, f.type), fs, entries, footers, shown) for f in fields)
    unit_file, unit_part, unit_rows, unit_begin, unit_end, unit_bytes, unit_decoded = ([] for _ in range(7))
    bounds: dict[str, tuple[Any, Any]] = {}
    deletions = dict(deletions or {})
    packed = {}
    for index, (entry, md) in enumerate(zip(entries, footers)):
        schema_here = md.schema.to_arrow_schema()
        for name in stored:
            at = schema_here.get_field_index(name)
            if at < 0:
                raise ConfigError(f"column {name!r} is in table file {shown(entries[0].path)!r} but not in "
                                  f"{shown(entry.path)!r}: the files' schemas differ. Fix: rewrite the table with "
                                  "one schema, or name only the columns every file holds")
            if not _compatible(schema_here.field(at).type, types[name]):
                raise ConfigError(f"column {name!r} is {types[name]} in table file {shown(entries[0].path)!r} but "
                                  f"{schema_here.field(at).type} in {shown(entry.path)!r}: the files' schemas "
                                  "differ. Fix: rewrite the table with one type per column (e.g. cast it in Spark "
                                  "or pyarrow before writing)")
        keep = deletions.get(index)
        if keep is not None:
            if len(keep) < md.num_rows:  # a selection vector may stop at the last deleted row
                keep = np.concatenate([keep, np.ones(md.num_rows - len(keep), bool)])
            if len(keep) != md.num_rows:
                raise ConfigError(f"the deletion vector of {shown(entry.path)!r} covers {len(keep)} rows but the "
                                  f"file holds {md.num_rows}. Fix: run OPTIMIZE (or REORG ... APPLY (PURGE)) on "
                                  "the Delta table so its files hold only live rows")
            packed[index] = np.packbits(keep).tobytes()
        leaf = {name: [] for name in stored}
        for i in range(md.num_columns):
            top = md.schema.column(i).path.split(".")[0]
            if top in leaf:
                leaf[top].append(i)
        raw = 0
        for group in range(md.num_row_groups):
            rg = md.row_group(group)
            rows = rg.num_rows
            fetched = decoded = 0
            for name, indices in leaf.items():
                for i in indices:
                    chunk = rg.column(i)
                    fetched += int(chunk.total_compressed_size)
                    decoded += int(chunk.total_uncompressed_size)
                    _bounds(bounds, name, chunk.statistics, shown(entry.path), nested="." in chunk.path_in_schema)
            live = rows if keep is None else int(keep[raw:raw + rows].sum())
            unit_file.append(index)
            unit_part.append(group)
            unit_rows.append(live)
            unit_begin.append(raw)
            unit_end.append(raw + rows)
            unit_bytes.append(fetched)
            unit_decoded.append(int(decoded * live / rows) if rows else 0)
            raw += rows
    as64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    plan = Plan(kind=kind, root=root, source=source, files=tuple(e.path for e in entries),
                sizes=tuple(e.size for e in entries), unit_file=as64(unit_file), unit_part=as64(unit_part),
                unit_rows=as64(unit_rows), unit_begin=as64(unit_begin), unit_end=as64(unit_end),
                unit_bytes=as64(unit_bytes), unit_decoded=as64(unit_decoded), columns=described, arrow_schema=schema,
                partitions=tuple(dict(p) for p in partitions) if partitions else tuple({} for _ in entries),
                deletions=packed, bounds=bounds)
    return plan


def _family(arrow_type: Any) -> Any:
    """What a type holds, whatever its encoding: a list and a fixed-size list of one type are one family, as are
    string and large_string (Delta has no fixed-size list: delta-rs writes a table's first file with the caller's
    Arrow type and later ones as lists)."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(arrow_type) or pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return ("list", _family(arrow_type.value_type))
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "binary"
    return str(arrow_type)


def _compatible(a: Any, b: Any) -> bool:
    return a == b or _family(a) == _family(b)


def _canonical(schemas: list[Any], name: str) -> Any:
    """The type a column is read as: the first file's, a fixed-size list where any file has one."""
    import pyarrow as pa

    types = [s.field(name).type for s in schemas if s.get_field_index(name) >= 0]
    fixed = [t for t in types if pa.types.is_fixed_size_list(t)]
    return fixed[0] if fixed and all(_compatible(t, fixed[0]) for t in types) else types[0]


def _width(column: Column, fs: Any, entries: Sequence[FileEntry], footers: list[Any], shown: Any) -> Column:
    """A list column without a fixed length in the schema gets the length of its first row (every row must
    have it; `columns.to_numpy` checks each batch)."""
    import pyarrow.parquet as pq

    if column.width is not None or not column.shape:
        return column
    for entry, md in zip(entries, footers):
        if md.num_rows == 0:
            continue
        with fs.open_input_file(entry.path) as handle:
            batch = next(pq.ParquetFile(handle, metadata=md).iter_batches(batch_size=1, columns=[column.name]))
        value = batch.column(0)
        if value.null_count:     # before the statistics are read (`_bounds`): refused as they refuse a null
            raise null_error(column.name, where=shown(entry.path), note=" (its first row)")
        shape = []
        while hasattr(value, "flatten") and value.type.num_fields == 1:
            shape.append(len(value[0]) if len(value) else 0)
            value = value.flatten()
        if len(shape) != len(column.shape):
            break
        return Column(column.name, column.dtype, tuple(shape))
    raise ConfigError(f"column {column.name!r} of {shown(entries[0].path)!r} holds arrays whose length cannot be "
                      "read. Fix: write it as a fixed-size list, or leave it out")


def _arrow_type(dtype: str) -> Any:
    import pyarrow as pa

    return pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype))


def _bounds(bounds: dict[str, tuple[Any, Any]], name: str, stats: Any, where: str, nested: bool = False) -> None:
    """Fold one column chunk's statistics into `bounds`; refuse nulls (of a list column, Parquet counts a null
    row, an empty list and a null element alike: `nested`)."""
    if stats is None:
        bounds.setdefault(name, (None, None))
        return
    if stats.has_null_count and stats.null_count:
        what = ("null or empty value(s) (a null row, an empty array or a null element: each row must hold a full "
                "array)" if nested else "null value(s)")
        raise null_error(name, stats.null_count, where, what)
    low, high = bounds.get(name, (None, None))
    if not stats.has_min_max or isinstance(stats.min, (bytes, str)):
        bounds[name] = (low, high)
        return
    try:
        low = stats.min if low is None else min(low, stats.min)
        high = stats.max if high is None else max(high, stats.max)
    except TypeError:
        return
    bounds[name] = (low, high)


def read_piece(plan: Plan, piece: Piece, names: Sequence[str], batch_rows: int, fs: Any,
               footers: dict[int, Any]) -> Iterator[Any]:
    """The rows of `piece` as `pyarrow.RecordBatch`es of the columns `names` (the plan's schema, in that order).

    Raises:
        FileNotFoundError: the file is gone; OSError: it cannot be read, or it changed size since the plan.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    unit = piece.unit
    file = int(plan.unit_file[unit])
    path = plan.files[file]
    values = plan.partitions[file] if plan.partitions else {}
    stored = [n for n in names if n not in values]
    handle = fs.open_input_file(path)
    if handle.size() != plan.sizes[file]:
        raise OSError(f"{path} is {handle.size()} bytes, not the {plan.sizes[file]} it had when the run planned "
                      "the table: it was rewritten")
    md = footers.get(file)
    reader = pq.ParquetFile(handle, metadata=md)   # pre-buffered: a row group's column chunks in few reads
    footers.setdefault(file, reader.metadata)
    keep = plan.keep_mask(file)
    begin = int(plan.unit_begin[unit])
    if keep is not None:
        live = np.flatnonzero(keep[begin:int(plan.unit_end[unit])])
        raw_first, raw_stop = int(live[piece.first]), int(live[piece.stop - 1]) + 1
    else:
        raw_first, raw_stop = piece.first, piece.stop
    schema = pa.schema([plan.arrow_schema.field(n) for n in names])
    at = 0
    try:
        for batch in reader.iter_batches(batch_size=batch_rows, row_groups=[int(plan.unit_part[unit])],
                                         columns=stored):
            end = at + batch.num_rows
            if end > raw_first:
                lo, hi = max(raw_first - at, 0), min(raw_stop, end) - at
                part = batch.slice(lo, hi - lo)
                if keep is not None:
                    part = part.filter(pa.array(keep[begin + at + lo:begin + at + hi]))
                for name, column in zip(part.schema.names, part.columns):
                    if column.null_count:   # a file without statistics: found here, named here
                        raise null_error(name, column.null_count, path, note=" (its statistics did not say)")
                yield _with_partitions(part, names, values, schema)
            at = end
            if at >= raw_stop:
                break
    finally:
        handle.close()


def _with_partitions(batch: Any, names: Sequence[str], values: dict[str, Any], schema: Any) -> Any:
    """`batch` with the partition columns' values added, every column in the plan's type (a list read as the
    plan's fixed-size list: a row of another length is refused, naming the column)."""
    import pyarrow as pa

    arrays = []
    for name in names:
        wanted = schema.field(name).type
        if name in values:
            arrays.append(pa.array([values[name]] * batch.num_rows, wanted))
            continue
        array = batch.column(name)
        if array.type != wanted:
            try:
                array = array.cast(wanted)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ConfigError(f"column {name!r} has a row that does not fit {wanted} ({exc}). Fix: give every "
                                  "row of an array column the same length") from None
        arrays.append(array)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


__all__ = ["FOOTER_THREADS", "plan_files", "read_piece"]
