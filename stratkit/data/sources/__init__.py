"""The sources a table is read from, one module each: Parquet files, Delta tables, TFRecord files.

Each turns a table description into a `stratkit.data.plan.Plan` (the snapshot and its units) and reads a
unit's rows back as `pyarrow.RecordBatch`es (`read_piece`); the listing, hive partitions and the partition
filter they share live in `files`.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from stratkit.data.plan import Piece, Plan


def read_piece(plan: Plan, piece: Piece, names: Sequence[str], batch_rows: int, fs: Any,
               cache: dict[int, Any]) -> Iterator[Any]:
    """The rows of `piece` as RecordBatches of the columns `names` (`cache`: per-reader footers/specs)."""
    if plan.kind == "tfrecord":
        from stratkit.data.sources import tfrecord

        return tfrecord.read_piece(plan, piece, names, batch_rows, fs, cache)
    from stratkit.data.sources import parquet

    return parquet.read_piece(plan, piece, names, batch_rows, fs, cache)


__all__ = ["read_piece"]
