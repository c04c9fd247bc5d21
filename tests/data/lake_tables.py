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
