"""Tables for the lake reader's tests and benchmarks: Parquet files of unequal sizes with row groups of several
sizes, the same rows as TFRecord shards, and Delta versions, with an `id` column numbering the rows.

Columns: `id` (int64, 0..rows-1 across the files in name order), `x` (3 float32s per row), `y` (float32, a
fixed function of x plus noise).
"""

from __future__ import annotations

import numpy as np


def table_rows(files: int, rows: int, seed: int = 0) -> list[int]:
    """Rows per file: unequal (a spread of 1 to ~6x), summing to `rows`."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1.0, 6.0, files)
    counts = np.floor(weights / weights.sum() * rows).astype(int)
    counts[: rows - counts.sum()] += 1
    return [int(c) for c in counts]


def columns(first: int, count: int, seed: int = 0):
    """The pyarrow table of rows [first, first + count)."""
    import pyarrow as pa

    rng = np.random.default_rng(first + 7919 * seed)
    x = rng.normal(size=(count, 3)).astype("float32")
    y = (x @ np.array([0.5, -1.0, 0.25], "float32") + 0.1 * rng.normal(size=count)).astype("float32")
    return pa.table({"id": pa.array(np.arange(first, first + count, dtype=np.int64)),
                     "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 3), "y": pa.array(y)})


def write_parquet(fs, base: str, files: int, rows: int, seed: int = 0, group_sizes=(97, 250, 613, 1500)) -> int:
    """`files` Parquet files under `base` on pyarrow filesystem `fs` (row groups of several sizes); the rows."""
    import pyarrow.parquet as pq

    at = 0
    for index, count in enumerate(table_rows(files, rows, seed)):
        group = group_sizes[index % len(group_sizes)]
        with fs.open_output_stream(f"{base}/part-{index:05d}.parquet") as out:
            pq.write_table(columns(at, count, seed), out, row_group_size=group)
        at += count
    return at


def write_tfrecord(fs, base: str, files: int, rows: int, seed: int = 0) -> int:
    """The same rows as tf.train.Example records in `files` TFRecord files; the rows."""
    import tensorflow as tf

    at = 0
    for index, count in enumerate(table_rows(files, rows, seed)):
        table = columns(at, count, seed)
        ids, xs, ys = (table.column(n).to_pylist() for n in ("id", "x", "y"))
        local = f"/tmp/stratkit-tfrecord-{index}-{np.random.default_rng().integers(1 << 30)}"
        with tf.io.TFRecordWriter(local) as writer:
            for i, x, y in zip(ids, xs, ys):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y]))}))
                writer.write(example.SerializeToString())
        with open(local, "rb") as source, fs.open_output_stream(f"{base}/shard-{index:05d}.tfrecord") as out:
            out.write(source.read())
        import os

        os.remove(local)
        at += count
    return at


def _z85(data: bytes) -> str:
    """Z85 (the Delta protocol's encoding of an inline deletion vector), zero-padded to whole 4-byte words."""
    import struct

    chars = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
    data = data + b"\0" * (-len(data) % 4)
    out = []
    for i in range(0, len(data), 4):
        value = struct.unpack(">I", data[i:i + 4])[0]
        block = []
        for _ in range(5):
            block.append(chars[value % 85])
            value //= 85
        out.extend(reversed(block))
    return "".join(out)


def deletion_vector(rows) -> bytes:
    """A Delta deletion vector of `rows` (< 65536): the magic number, then a 64-bit roaring bitmap of one 32-bit
    bitmap (key 0) holding one array container (the portable format, no run containers)."""
    import struct

    values = sorted(int(r) for r in rows)
    container = struct.pack(f"<{len(values)}H", *values)
    bitmap = struct.pack("<II", 12346, 1) + struct.pack("<HH", 0, len(values) - 1) + struct.pack("<I", 16) + container
    return struct.pack("<i", 1681511377) + struct.pack("<Q", 1) + struct.pack("<I", 0) + bitmap


def delete_with_vector(table_path: str, rows) -> str:
    """Commit a deletion vector deleting `rows` of the table's first data file (as Spark or Databricks would:
    delta-rs writes none itself); returns that file's path in the table."""
    import json
    import os
    import time

    log = os.path.join(table_path, "_delta_log")
    commits = sorted(n for n in os.listdir(log) if n.endswith(".json"))
    live = {}
    for name in commits:
        for line in open(os.path.join(log, name)):
            action = json.loads(line)
            if "add" in action:
                live[action["add"]["path"]] = action["add"]
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    add = live[sorted(live)[0]]
    data = deletion_vector(rows)
    vector = {"storageType": "i", "pathOrInlineDv": _z85(data), "sizeInBytes": len(data), "cardinality": len(rows)}
    now = int(time.time() * 1000)
    actions = [{"commitInfo": {"timestamp": now, "operation": "DELETE"}},
               {"remove": {"path": add["path"], "dataChange": True, "deletionTimestamp": now,
                           "extendedFileMetadata": True, "partitionValues": add.get("partitionValues", {}),
                           "size": add["size"]}},
               {"add": {**add, "deletionVector": vector, "modificationTime": now, "dataChange": True}}]
    with open(os.path.join(log, f"{len(commits):020d}.json"), "w") as out:
        out.write("\n".join(json.dumps(a) for a in actions) + "\n")
    return add["path"]
