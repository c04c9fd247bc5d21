"""Data at scale: tables (Parquet, Delta, TFRecord) on local disks and object stores, read into training.

The layer between the strategy and training: it knows tables, columns and orders, not strategies or
fits. One module per job: `columns` (one column -> one model input's values, in its own type, never a cast that
loses a value), `signature` (what a model takes and gives: its inputs and outputs, their nesting, shapes and
dtypes), `feeds` (which columns feed which input, labels to outputs; an Arrow batch -> the model's batch).
"""

from __future__ import annotations

from stratkit.data.columns import Column, cast_to, column_of, label_dtype, to_numpy
from stratkit.data.feeds import Batch, Feed, FeedPlan, Names, Target, plan_feeds, plan_for_model
from stratkit.data.signature import ModelSignature, Port, describe

__all__ = ["Batch", "Column", "Feed", "FeedPlan", "ModelSignature", "Names", "Port", "Target", "cast_to", "column_of",
           "describe", "label_dtype", "plan_feeds", "plan_for_model", "to_numpy"]
