"""The plan of a table: its snapshot and its units, small and picklable, the same in every process.

A plan says what a run reads, without holding a row of it:

* the snapshot: the source's own record (a Delta version; the files of a Parquet listing with their sizes
  and modification tags; TFRecord files with their sizes), and `fingerprint`, a hash of everything below;
* the units, in a canonical order (files by name, then row groups or record ranges in file order): for
  each, its file, its place in the file, its rows (after a Delta deletion vector is applied), the bytes a
  read fetches and the bytes its rows take decoded (for the read-ahead budget);
* the columns (`stratkit.data.columns.Column`), and per file the values of its partition columns;
* Delta deletion vectors, as packed keep-masks per file.

`Stream` is one epoch's view of it: the units in that epoch's order (`order.unit_order`) and where each
starts in the stream, so a stream row range maps to (unit, first row, last row) pieces.

A plan is built by a source (`stratkit.data.sources`) and travels pickled (a driver plans once and every task
of a Spark or Ray run reads the same plan) and by its record in the backups.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from stratkit.data import order
from stratkit.data.columns import Column


@dataclass(frozen=True)
class Plan:
    """One snapshot of a table: its files, units and columns (see the module docstring)."""

    kind: str                               # "parquet", "delta" or "tfrecord"
    root: str                               # the table's path or URL, as the user gave it
    source: dict[str, Any]                  # the source's own record (JSON): version, listing, feature spec
    files: tuple[str, ...]                  # each file's path as the filesystem names it
    sizes: tuple[int, ...]                  # each file's size in bytes
    unit_file: np.ndarray                   # int64 per unit: index into files
    unit_part: np.ndarray                   # int64 per unit: row group (Parquet), or first record (TFRecord)
    unit_rows: np.ndarray                   # int64 per unit: rows it gives (after deletions)
    unit_begin: np.ndarray                  # int64 per unit: first raw row in its file (Parquet) / first byte
    unit_end: np.ndarray                    # int64 per unit: end raw row (Parquet) / end byte (TFRecord)
    unit_bytes: np.ndarray                  # int64 per unit: bytes a read fetches
    unit_decoded: np.ndarray                # int64 per unit: bytes its rows take decoded (estimate)
    columns: tuple[Column, ...]             # what each readable column holds
    arrow_schema: Any = None                # pyarrow.Schema of the columns as read (partition columns included)
    partitions: tuple[dict[str, Any], ...] = ()  # per file: partition column -> value
    deletions: dict[int, bytes] = field(default_factory=dict)  # file index -> np.packbits(keep mask)
    bounds: dict[str, tuple[Any, Any]] = field(default_factory=dict, compare=False)  # column -> (min, max) stats

    @property
    def rows(self) -> int:
        return int(self.unit_rows.sum())

    @property
    def units(self) -> int:
        return int(len(self.unit_rows))

    @property
    def nbytes(self) -> int:
        """Bytes one pass fetches."""
        return int(self.unit_bytes.sum())

    @property
    def row_bytes(self) -> float:
        """Decoded bytes per row (an estimate from the footers)."""
        return float(self.unit_decoded.sum()) / max(self.rows, 1)

    def column(self, name: str) -> Column:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(name)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the snapshot and its units: equal plans read equal rows."""
        digest = hashlib.sha256()
        digest.update(json.dumps([self.kind, self.source, list(self.files), list(self.sizes),
                                  [[c.name, c.dtype, list(c.shape)] for c in self.columns],
                                  [sorted(p.items()) for p in self.partitions]],
                                 sort_keys=True, default=str).encode())
        for array in (self.unit_file, self.unit_part, self.unit_rows, self.unit_begin, self.unit_end):
            digest.update(np.ascontiguousarray(array, np.int64).tobytes())
        for index in sorted(self.deletions):
            digest.update(str(index).encode() + self.deletions[index])
        return digest.hexdigest()

    def keep_mask(self, file: int) -> np.ndarray | None:
        """The rows of file `file` a deletion vector keeps (bool per raw row), None without one."""
        packed = self.deletions.get(file)
        if packed is None:
            return None
        return np.unpackbits(np.frombuffer(packed, np.uint8)).astype(bool)

    def stream(self, seed: int, epoch: int, shuffle: bool = True) -> Stream:
        return Stream(self, order.unit_order(self.units, seed, epoch, shuffle))


@dataclass(frozen=True)
class Piece:
    """Rows [first, stop) of unit `unit` (counted after deletions)."""

    unit: int
    first: int
    stop: int


class Stream:
    """An epoch's stream: the plan's units in `units` order, concatenated."""

    def __init__(self, plan: Plan, units: np.ndarray) -> None:
        self.plan = plan
        self.units = units
        self.ends = np.cumsum(plan.unit_rows[units])  # stream row where each unit in order ends

    def fetched(self, first: int, stop: int) -> int:
        """Bytes a reader of stream rows [first, stop) fetches: every unit it touches, whole."""
        return int(sum(int(self.plan.unit_bytes[p.unit]) for p in self.pieces(first, stop)))

    def pieces(self, first: int, stop: int) -> list[Piece]:
        """The units holding stream rows [first, stop), with the rows of each."""
        out: list[Piece] = []
        at = int(first)
        k = int(np.searchsorted(self.ends, at, side="right"))
        while at < stop and k < len(self.units):
            begin = int(self.ends[k - 1]) if k else 0
            end = int(self.ends[k])
            take = min(end, stop)
            if take > at:
                out.append(Piece(int(self.units[k]), at - begin, take - begin))
            at = take
            k += 1
        return out


__all__ = ["Piece", "Plan", "Stream"]
