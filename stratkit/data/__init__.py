"""Data at scale: tables (Parquet, Delta, TFRecord) on local disks and object stores, read into training.

The layer between the strategy and training: it knows tables, columns and orders, not strategies or fits.
One module per job:

| module | job |
|---|---|
| `columns` | one column -> one model input's values, in its own type, never a cast that loses a value |
| `table` | `Table`: a Parquet, Delta or TFRecord table, described until planned |
| `sources/` | listing and partitions (`files`), `parquet`, `delta`, `tfrecord`: a table's plan, a unit's rows |
| `plan` | `Plan`: a snapshot and its units, small and picklable; an epoch's `Stream` |
| `order` | each epoch's permutations, a function of (seed, epoch) |
| `shards` | lanes, the global order over them, which rows each worker takes |
| `cursor` | (snapshot, pass, batch): what a backup records, where a resume reads |
| `feed` | which columns feed which model input; rows -> (x, y, sample_weight) arrays |
| `readahead` | one worker's reader: background fetch and decode within a byte budget, batches per replica |
| `table_input` | `TableInput`: the public input `Trainer.fit` and a hand-written fit take |

See docs/data.md.
"""

from __future__ import annotations

from stratkit.data.columns import Column, cast_to, column_of, label_dtype, to_numpy
from stratkit.data.cursor import Cursor, OrderRecord
from stratkit.data.readahead import TableReadError
from stratkit.data.table import Table
from stratkit.data.table_input import TableInput

__all__ = ["Column", "Cursor", "OrderRecord", "Table", "TableInput", "TableReadError", "cast_to", "column_of",
           "label_dtype", "to_numpy"]
