"""How one column of a table becomes one model input's (or label's) values: in its own type, cast only where the
model asks for another, and never a cast that loses a value.

A column keeps what the table stores: int64 ids stay int64 (exact at any value; a float32 matrix holds integers
exactly only up to 2^24), float64 stays float64, strings stay strings (for `StringLookup`, `TextVectorization`,
`FeatureSpace`), and a list column keeps its length. The model's input dtype decides the cast, as Keras casts an
input array to its `keras.Input`'s dtype on one process, with one difference: a cast that would change a value
is a `ConfigError` naming the column, never a silent rounding:

* an integer into a float type beyond the integers that type holds exactly (2^24 for float32, 2^53 for float64,
  2^11 for float16, 2^8 for bfloat16);
* a float with a fractional part, an infinity or a NaN into an integer type, or any value outside the target's
  range (int64 into int32, a negative into uint8, 2 into bool);
* a finite float beyond the target float's range (1e300 into float32 would become inf).

A float into a narrower float (float64 into float32) rounds, as Keras does on one process: it is allowed.
A string column feeds only a string input, and a number only a number input.

Labels travel in their own type (`label_dtype`): Keras's losses cast them to the prediction's dtype, as they do
for one process's numpy labels.

Used by every reader of typed columns: Spark's staged DataFrames and `keras_predict`, and the lake reader.
pyarrow and numpy are imported when a function needs them (this module is pure Python to import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stratkit.errors import ConfigError

#: Integer dtypes, and the values each holds.
INT_RANGES: dict[str, tuple[int, int]] = {
    "int8": (-2**7, 2**7 - 1), "int16": (-2**15, 2**15 - 1), "int32": (-2**31, 2**31 - 1),
    "int64": (-2**63, 2**63 - 1), "uint8": (0, 2**8 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}
#: The largest integer magnitude each float type holds exactly (every integer up to it, 2^(mantissa bits + 1)).
EXACT_INTEGERS: dict[str, int] = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}
#: The largest finite value of each float type.
FLOAT_MAX: dict[str, float] = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
                               "float64": 1.7976931348623157e308}
NUMBER_DTYPES = (*INT_RANGES, *EXACT_INTEGERS, "bool")
#: What a string column holds, as a dtype name (Keras's and TensorFlow's name for it).
STRING = "string"


@dataclass(frozen=True)
class Column:
    """What a column holds, from its schema alone: its name, the dtype of its values and their shape per row.

    `shape` is () for a scalar, (L,) for a list of L values, (a, b) for a list of lists; a dimension is None where
    the schema does not fix it (a variable-length list: the rows tell, and must agree).
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...] = ()

    @property
    def width(self) -> int | None:
        """Values per row (1 for a scalar), None while a dimension is unknown."""
        out = 1
        for d in self.shape:
            if d is None:
                return None
            out *= d
        return out

    @property
    def is_string(self) -> bool:
        return self.dtype == STRING


def _why_not(name: str, shown: str, fix: str) -> ConfigError:
    return ConfigError(f"column {name!r} has type {shown}, which cannot feed a model. Fix: {fix}")


def column_of(name: str, arrow_type: Any) -> Column:
    """The `Column` an Arrow field type (`pyarrow.DataType`) describes.

    Raises:
        ConfigError: a type that feeds no model input (timestamps, structs, maps, a decimal that no int64/float64
            holds exactly), naming the column and the cast to make.
    """
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = column_of(name, t.value_type)
        length = t.list_size if pa.types.is_fixed_size_list(t) else None
        return Column(name, inner.dtype, (length, *inner.shape))
    if pa.types.is_boolean(t):
        return Column(name, "bool")
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return Column(name, str(t.to_pandas_dtype().__name__) if pa.types.is_floating(t) else str(t))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return Column(name, STRING)
    if pa.types.is_decimal(t):
        if t.scale == 0 and t.precision <= 18:
            return Column(name, "int64")
        if t.precision <= 15:
            return Column(name, "float64")
        raise _why_not(name, str(t), "cast it in the DataFrame to a type that holds its values (e.g. "
                                     "col.cast('double') when 15 significant digits are enough, or 'long' for "
                                     "whole numbers)")
    if pa.types.is_temporal(t):
        raise _why_not(name, str(t), "turn it into numbers first (e.g. unix_timestamp(col) or datediff), or leave "
                                     "it out of the feature columns")
    raise _why_not(name, str(t), "use numbers, strings, or (fixed-length) arrays of them; flatten structs and maps "
                                 "into columns of their own")


def float_name(dtype: Any) -> str:
    """numpy's name of a dtype (`np.dtype('float32')` -> 'float32'), or the name given."""
    return str(getattr(dtype, "name", dtype))


def cast_to(column: Column, wanted: str, what: str = "input") -> str:
    """The dtype `column`'s values take to feed a model `what` of dtype `wanted` (a Keras dtype name): `wanted`,
    when the kinds agree.

    Raises:
        ConfigError: a string column for a number input, or a number column for a string input.
    """
    wanted = float_name(wanted)
    if column.is_string and wanted != STRING:
        raise ConfigError(f"column {column.name!r} holds strings but the model's {what} takes {wanted} values. "
                          "Fix: build the model with keras.Input(dtype='string') followed by a StringLookup, "
                          "TextVectorization or FeatureSpace layer, or index the strings into numbers before "
                          "training (e.g. pyspark.ml.feature.StringIndexer)")
    if not column.is_string and wanted == STRING:
        raise ConfigError(f"column {column.name!r} holds {column.dtype} numbers but the model's {what} takes "
                          "strings. Fix: feed it a string column, or build the input with the column's dtype "
                          f"(keras.Input(..., dtype={column.dtype!r}))")
    if wanted not in NUMBER_DTYPES and wanted != STRING:
        raise ConfigError(f"the model's {what} takes {wanted} values, which column {column.name!r} cannot give. "
                          f"Fix: build the input with one of {', '.join(NUMBER_DTYPES)} or 'string'")
    return wanted


def label_dtype(column: Column) -> str:
    """The dtype a label column travels in: its own (Keras's losses cast labels to the prediction's dtype, as they
    do for one process's numpy labels), with unsigned types TensorFlow's losses lack widened to int64."""
    if column.dtype in ("uint16", "uint32", "uint64"):
        return "int64"
    return column.dtype


def may_lose(source: str, target: str) -> bool:
    """Whether some value of dtype `source` changes when cast to `target` (so the values must be checked)."""
    if source == target or STRING in (source, target):
        return False
    if target == "bool":
        return True
    if source == "bool":
        return False
    if source in INT_RANGES and target in INT_RANGES:
        low, high = INT_RANGES[source]
        t_low, t_high = INT_RANGES[target]
        return low < t_low or high > t_high
    if source in INT_RANGES:                       # into a float: exact up to its mantissa
        low, high = INT_RANGES[source]
        return max(-low, high) > EXACT_INTEGERS[target]
    if target in INT_RANGES:                       # a float into an integer
        return True
    return FLOAT_MAX[source] > FLOAT_MAX[target]   # a float into a narrower float: finite values may overflow


def lossless_bounds(source: str, target: str) -> tuple[float, float] | None:
    """The values of `source` that `target` holds without change, as a closed range (None: any value); for checks
    against min/max statistics before reading any row (floats into integers also need whole numbers)."""
    if not may_lose(source, target):
        return None
    if target == "bool":
        return (0, 1)
    if target in INT_RANGES:
        return INT_RANGES[target]
    if source in INT_RANGES:
        return (-EXACT_INTEGERS[target], EXACT_INTEGERS[target])
    return (-FLOAT_MAX[target], FLOAT_MAX[target])


def _lost(name: str, source: str, target: str, example: Any, fix: str) -> ConfigError:
    return ConfigError(f"column {name!r}: casting its {source} values to the model's {target} would change them "
                       f"(e.g. {example!r}). Fix: {fix}")


def _fix(source: str, target: str) -> str:
    if source in INT_RANGES and target in EXACT_INTEGERS:
        return (f"build the model's input with dtype={source!r} (an id into IntegerLookup/Embedding/Hashing), or "
                f"scale the values into the range {target} holds exactly (+-{EXACT_INTEGERS[target]})")
    return f"build the model's input with dtype={source!r}, or fix the column's values in the table"


def check_range(name: str, source: str, target: str, low: Any, high: Any) -> None:
    """Refuse the cast when a column's smallest or largest value (e.g. from Parquet statistics) would change.

    Raises:
        ConfigError: naming the column, the value and the fix.
    """
    bounds = lossless_bounds(source, target)
    if bounds is None or low is None or high is None:
        return
    for value in (low, high):
        if source in EXACT_INTEGERS and target in EXACT_INTEGERS and not math.isfinite(value):
            continue  # inf and NaN stay what they are in any float type (a finite value beyond is found as read)
        if not bounds[0] <= value <= bounds[1]:
            raise _lost(name, source, target, value, _fix(source, target))


def check_values(values: Any, name: str, target: str) -> None:
    """Refuse the cast of a numpy array's values to `target` if any value would change.

    Raises:
        ConfigError: naming the column, one value that would change, and the fix.
    """
    import numpy as np

    source = float_name(values.dtype)
    if source == "object" or not may_lose(source, target) or values.size == 0:
        return
    flat = values.reshape(-1)
    if target in INT_RANGES or target == "bool":
        low, high = (0, 1) if target == "bool" else INT_RANGES[target]
        if source in EXACT_INTEGERS:
            bad = ~np.isfinite(flat) | (flat != np.trunc(flat)) | (flat < low) | (flat > high)
        elif source == "uint64" or target == "uint64":  # compare without a float detour
            bad = np.array([not low <= int(v) <= high for v in flat]) if flat.size else np.zeros(0, bool)
        else:
            bad = (flat < low) | (flat > high)
    elif source in INT_RANGES:
        limit = EXACT_INTEGERS[target]
        bad = (flat > limit) if source.startswith("uint") else (flat > limit) | (flat < -limit)
    else:
        bad = np.isfinite(flat) & (np.abs(flat) > FLOAT_MAX[target])
    if bad.any():
        raise _lost(name, source, target, flat[np.argmax(bad)].item(), _fix(source, target))


def to_numpy(array: Any, column: Column, dtype: str) -> Any:
    """An Arrow array (or chunked array) of `column` as a numpy array of `dtype`, shaped (rows, *column's shape).

    Strings come out as an object array of `bytes` (what `tf.constant` takes for a string tensor).

    Raises:
        ConfigError: nulls, lists of different lengths where the schema does not fix one, or a value the cast would
            change (`check_values`).
    """
    import numpy as np
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    rows = len(array)
    shape: list[int] = []
    values = array
    while pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type) or \
            pa.types.is_large_list(values.type):
        if values.null_count:
            raise null_error(column.name, values.null_count)
        lengths = np.asarray(values.value_lengths()) if not pa.types.is_fixed_size_list(values.type) else None
        length = values.type.list_size if lengths is None else (int(lengths[0]) if len(lengths) else 0)
        if lengths is not None and len(lengths) and (lengths != length).any():
            raise ConfigError(f"column {column.name!r} holds arrays of different lengths ({int(lengths.min())} to "
                              f"{int(lengths.max())}). Fix: pad or trim them to one length before training")
        shape.append(length)
        values = values.flatten()
    if values.null_count:
        raise null_error(column.name, values.null_count)
    if column.is_string:
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            values = values.cast(pa.large_binary())
        out = np.asarray(values.to_numpy(zero_copy_only=False), dtype=object)
    else:
        out = np.asarray(values.to_numpy(zero_copy_only=False))
        if pa.types.is_decimal(values.type):
            out = out.astype("int64" if column.dtype == "int64" else "float64")
        check_values(out, column.name, dtype)
        out = out.astype(dtype if dtype != "bfloat16" else "float32", copy=False)
    return out.reshape((rows, *shape))


def null_error(name: str, count: int | None = None, where: str | None = None, what: str = "null value(s)",
               note: str = "") -> ConfigError:
    """The refusal of nulls in column `name`: `where` the table file holding them (None: the data is not a
    table's file), `what` they are, `note` how they were found."""
    counted = f"{count} {what}" if count else what
    if where is None:
        return ConfigError(f"column {name!r} has {counted}{note}. Fix: fill or drop them before training (e.g. "
                           "df.na.fill / df.na.drop, or a filter on the table)")
    return ConfigError(f"column {name!r} has {counted} in table file {where!r}{note}. Fix: fill or drop them before "
                       "training (e.g. df.na.fill / df.na.drop before writing the table), or leave the column out")


__all__ = ["Column", "EXACT_INTEGERS", "INT_RANGES", "STRING", "cast_to", "check_range", "check_values", "column_of",
           "label_dtype", "lossless_bounds", "may_lose", "null_error", "to_numpy"]
