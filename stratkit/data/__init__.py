"""Data at scale: tables (Parquet, Delta, TFRecord) on local disks and object stores, read into training.

The layer between the strategy and training: it knows tables, columns and orders, not strategies or
fits. One module per job: `columns` (one column -> one model input's values, in its own type, never a cast that
loses a value).
"""

from __future__ import annotations

from stratkit.data.columns import Column, cast_to, column_of, label_dtype, to_numpy

__all__ = ["Column", "cast_to", "column_of", "label_dtype", "to_numpy"]
