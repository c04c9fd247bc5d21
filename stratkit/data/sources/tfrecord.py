"""TFRecord files of `tf.train.Example`: record ranges as units, parsed in batches with a feature spec.

TensorFlow cannot read `s3://` any more (removed from `tf.io.gfile` in TF 2.6; tensorflow-io supports
nothing past TF 2.17), so the bytes come through the store layer's filesystem and TensorFlow only parses.

Planning scans every file once (its record headers: the file is read in large sequential chunks), counting
records and cutting the file into units of about `UNIT_BYTES` bytes (a unit: a byte range and its record
count). The feature spec is checked on the first record of every file before any training: a feature the
spec names that a record lacks (without a default), or of another type, is a ConfigError naming the feature,
the file and the fix. Only `tf.io.FixedLenFeature`s are read (a fixed shape per row, as a model input needs).

Reading a piece fetches its unit's byte range in one read, splits it into records (their CRCs are not
checked: the length framing is), and parses the records asked for with one `tf.io.parse_example` per batch.
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np

from stratkit.data.columns import Column
from stratkit.data.plan import Piece, Plan
from stratkit.data.sources.files import FileEntry
from stratkit.errors import ConfigError

UNIT_BYTES = 4 << 20
_CHUNK = 8 << 20
_HEADER = struct.Struct("<Q")


def feature_columns(features: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], tuple[Column, ...]]:
    """The spec as JSON (for the record) and the columns it describes.

    Raises:
        ConfigError: a feature that is not a `tf.io.FixedLenFeature`.
    """
    import tensorflow as tf

    if not isinstance(features, dict) or not features:
        raise ConfigError("Table.tfrecord needs features={name: tf.io.FixedLenFeature(shape, dtype), ...}. Fix: "
                          "describe each feature of the tf.train.Example records")
    spec, columns = {}, []
    for name, feature in features.items():
        if not isinstance(feature, tf.io.FixedLenFeature):
            raise ConfigError(f"feature {name!r} is a {type(feature).__name__}: only tf.io.FixedLenFeature "
                              "(a fixed shape per record) can feed a model input. Fix: write the records with a "
                              "fixed length (pad them), and describe them with tf.io.FixedLenFeature")
        dtype = "string" if feature.dtype == tf.string else feature.dtype.name
        shape = tuple(int(d) for d in feature.shape)
        default = feature.default_value
        spec[name] = {"shape": list(shape), "dtype": dtype,
                      "default": None if default is None else np.asarray(default).tolist()}
        columns.append(Column(name, dtype, shape))
    return spec, tuple(columns)


def parse_spec(spec: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import tensorflow as tf

    return {name: tf.io.FixedLenFeature(f["shape"], tf.string if f["dtype"] == "string" else tf.dtypes.as_dtype(
        f["dtype"]), default_value=f["default"]) for name, f in spec.items()}


def _compression(handle: Any) -> str | None:
    """"GZIP" or "ZLIB" when a file that did not scan as TFRecord starts as one of those streams (asked only then:
    a record's length can begin with the same bytes)."""
    try:
        head = bytes(handle.read_at(2, 0))
    except (OSError, ValueError):
        return None
    if head == b"\x1f\x8b":
        return "GZIP"
    if len(head) == 2 and head[0] == 0x78 and (head[0] * 256 + head[1]) % 31 == 0:
        return "ZLIB"
    return None


def _scan(fs: Any, entry: FileEntry, shown: str) -> tuple[list[tuple[int, int, int]], bytes]:
    """(first byte, end byte, records) of each unit of one file, and its first record."""
    def truncated(at: int) -> ConfigError:
        kind = _compression(handle)
        if kind:
            return ConfigError(f"TFRecord file {shown!r} is {kind}-compressed (its first bytes say so): this reader "
                               "reads uncompressed TFRecord files only. Fix: write the records uncompressed "
                               "(tf.io.TFRecordWriter(path) without options), or decompress the files first")
        return ConfigError(f"TFRecord file {shown!r} ends inside a record (at byte {at} of {entry.size}): it is "
                           "truncated or not a TFRecord file. Fix: rewrite it, or leave it out of the table")

    try:
        handle = fs.open_input_file(entry.path)   # ranged reads: an fsspec stream read far slower (GCS)
    except FileNotFoundError:
        raise ConfigError(f"TFRecord file {shown!r} was listed but is gone. Fix: do not rewrite the files while a "
                          "run starts") from None
    units: list[tuple[int, int, int]] = []
    first_record = b""
    buffer, base = bytearray(), 0          # buffer holds the file's bytes [base, base + len(buffer))
    at, unit_start, count = 0, 0, 0

    def have(n: int) -> bool:
        """Read on until the buffer holds [at, at + n) (the bytes before `at` are dropped)."""
        nonlocal buffer, base
        if at + n <= base + len(buffer):
            return True
        if at + n > entry.size:
            return False
        keep = buffer[at - base:] if at < base + len(buffer) else bytearray()
        start = at + len(keep)
        more = handle.read_at(max(min(_CHUNK, entry.size - start), at + n - start), start)
        buffer, base = keep + more, at
        return at + n <= base + len(buffer)

    with handle:
        while at < entry.size:
            if not have(12):
                raise truncated(at)
            length = _HEADER.unpack_from(buffer, at - base)[0]
            end = at + 12 + length + 4
            if end > entry.size:
                raise truncated(at)
            if not first_record:
                if not have(12 + length):
                    raise truncated(at)
                first_record = bytes(buffer[at - base + 12:at - base + 12 + length])
            count += 1
            at = end
            if at - unit_start >= UNIT_BYTES:
                units.append((unit_start, at, count))
                unit_start, count = at, 0
    if count:
        units.append((unit_start, at, count))
    return units, first_record


def plan_files(*, root: str, source: dict[str, Any], fs: Any, entries: Sequence[FileEntry],
               features: dict[str, Any], shown: Any) -> Plan:
    """The plan of TFRecord `entries`: every file scanned, the spec checked on each file's first record."""
    import pyarrow as pa

    spec, columns = feature_columns(features)
    with ThreadPoolExecutor(min(8, max(len(entries), 1)), thread_name_prefix="stratkit-tfrecord-scan") as pool:
        scans = list(pool.map(lambda e: _scan(fs, e, shown(e.path)), entries))
    parsed = parse_spec(spec)
    for entry, (_, first) in zip(entries, scans):
        if first:
            _parse([first], parsed, shown(entry.path))
    unit_file, unit_part, unit_rows, unit_begin, unit_end = [], [], [], [], []
    for index, (units, _) in enumerate(scans):
        record = 0
        for begin, end, count in units:
            unit_file.append(index)
            unit_part.append(record)
            unit_rows.append(count)
            unit_begin.append(begin)
            unit_end.append(end)
            record += count
    as64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    sizes = as64(unit_end) - as64(unit_begin)
    schema = pa.schema([pa.field(c.name, _arrow_type(c)) for c in columns])
    return Plan(kind="tfrecord", root=root, source={**source, "features": spec},
                files=tuple(e.path for e in entries), sizes=tuple(e.size for e in entries),
                unit_file=as64(unit_file), unit_part=as64(unit_part), unit_rows=as64(unit_rows),
                unit_begin=as64(unit_begin), unit_end=as64(unit_end), unit_bytes=sizes, unit_decoded=sizes,
                columns=columns, arrow_schema=schema, partitions=tuple({} for _ in entries))


def _arrow_type(column: Column) -> Any:
    import pyarrow as pa

    out = pa.large_binary() if column.is_string else pa.from_numpy_dtype(np.dtype(column.dtype))
    for size in reversed(column.shape):
        out = pa.list_(out, size)
    return out


def _parse(records: list[bytes], parsed: dict[str, Any], where: str) -> dict[str, np.ndarray]:
    import tensorflow as tf

    try:
        out = tf.io.parse_example(tf.constant(records, tf.string), parsed)
    except (tf.errors.InvalidArgumentError, ValueError) as exc:
        text = str(getattr(exc, "message", exc)).splitlines()[0]
        raise ConfigError(f"the TFRecord records of {where!r} do not match features= ({text}). Fix: describe each "
                          "feature with the shape and dtype the records hold (tf.io.FixedLenFeature(shape, dtype), "
                          "a default_value for a feature some records lack)") from None
    return {name: value.numpy() for name, value in out.items()}


def split_records(data: bytes) -> list[bytes]:
    """The records of a run of whole TFRecord frames."""
    out, at, view = [], 0, memoryview(data)
    while at + 12 <= len(data):
        length = _HEADER.unpack_from(data, at)[0]
        out.append(bytes(view[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return out


def read_piece(plan: Plan, piece: Piece, names: Sequence[str], batch_rows: int, fs: Any,
               footers: dict[int, Any]) -> Iterator[Any]:
    """The records of `piece`, parsed, as `pyarrow.RecordBatch`es of the features `names`."""
    import pyarrow as pa

    unit = piece.unit
    file = int(plan.unit_file[unit])
    begin, end = int(plan.unit_begin[unit]), int(plan.unit_end[unit])
    with fs.open_input_file(plan.files[file]) as handle:
        if handle.size() != plan.sizes[file]:
            raise OSError(f"{plan.files[file]} is {handle.size()} bytes, not the {plan.sizes[file]} it had when the "
                          "run planned the table: it was rewritten")
        data = handle.read_at(end - begin, begin)
    records = split_records(data)[piece.first:piece.stop]
    parsed = footers.get(-1)
    if parsed is None:
        parsed = footers[-1] = parse_spec(plan.source["features"])
    schema = pa.schema([plan.arrow_schema.field(n) for n in names])
    for at in range(0, len(records), batch_rows):
        values = _parse(records[at:at + batch_rows], {n: parsed[n] for n in names}, plan.files[file])
        arrays = [_arrow_array(values[n], schema.field(n).type) for n in names]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def _arrow_array(values: np.ndarray, arrow_type: Any) -> Any:
    import pyarrow as pa

    rows = values.shape[0]
    flat = values.reshape(-1)
    leaf = arrow_type
    sizes = []
    while pa.types.is_fixed_size_list(leaf):
        sizes.append(leaf.list_size)
        leaf = leaf.value_type
    out = pa.array(list(flat) if flat.dtype == object else flat, leaf)
    for size in reversed(sizes):
        out = pa.FixedSizeListArray.from_arrays(out, size)
    assert len(out) == rows
    return out


__all__ = ["UNIT_BYTES", "feature_columns", "plan_files", "read_piece", "split_records"]
