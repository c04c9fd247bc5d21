"""Data at scale: tables (Parquet, Delta, TFRecord) on local disks and object stores, read into training.

The layer between the strategy and training: it knows tables, columns and orders, not strategies or fits.
One module per job:

| module | job |
|---|---|
| `columns` | one column -> one model input's values, in its own type, never a cast that loses a value |
| `signature` | what a model takes and gives: its inputs and outputs, their nesting, shapes and dtypes |
| `feeds` | which columns feed which input, labels to outputs; an Arrow batch -> the model's batch |
| `table` | `Table`: a Parquet, Delta or TFRecord table, described until planned |
| `sources/` | listing and partitions (`files`), `parquet`, `delta`, `tfrecord`: a table's plan, a unit's rows |
| `plan` | `Plan`: a snapshot and its units, small and picklable; an epoch's `Stream` |
| `order` | each epoch's permutations, a function of (seed, epoch) |
| `shards` | lanes, the global order over them, which rows each worker takes |
| `cursor` | (snapshot, pass, batch): what a backup records, where a resume reads |
| `batching` | a feed plan's batches as flat arrays (gathered, cut, handed to tf.data) and their TensorSpecs |
| `readahead` | one worker's reader: background fetch and decode within a byte budget, batches per replica |
| `table_input` | `TableInput`: the public input `Trainer.fit` and a hand-written fit take |

See docs/data.md.
"""

from __future__ import annotations

from stratkit.data.columns import Column, cast_to, column_of, label_dtype, to_numpy
from stratkit.data.cursor import Cursor, OrderRecord
from stratkit.data.feeds import Batch, Feed, FeedPlan, Names, Target, plan_feeds, plan_for_model
from stratkit.data.readahead import TableReadError
from stratkit.data.signature import ModelSignature, Port, describe
from stratkit.data.table import Table
from stratkit.data.table_input import TableInput

__all__ = ["Batch", "Column", "Cursor", "Feed", "FeedPlan", "ModelSignature", "Names", "OrderRecord", "Port", "Table",
           "TableInput", "TableReadError", "Target", "cast_to", "column_of", "describe", "label_dtype", "plan_feeds",
           "plan_for_model", "to_numpy"]
