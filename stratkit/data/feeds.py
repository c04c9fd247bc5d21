"""Which table columns feed which model input, labels to outputs, and one Arrow batch -> the model's batch.

The one rule, for training and scoring alike, on every engine (Spark's staged DataFrames and scoring UDF, the
lake reader):

* a model with **one input** takes every feature column, side by side in the order given (a scalar column is
  one value, an array its length), reshaped to the input's per-row shape: 64 values feed an input of shape
  (8, 8, 1);
* a model with **N inputs** takes one column per input, in the order of `model.inputs` (a dict's keys sorted,
  as Keras flattens them), and gets them in its own structure: a list, a tuple or a dict keyed as built;
* **one label column per output**, in the outputs' order and structure; a label with as many values as its
  output takes the output's shape, a one-value label of a wider output (a class index for a softmax) stays one
  value per row; **sample weights** one number per row;
* each column keeps its own type and takes its input's dtype by `stratkit.data.columns` (int64 ids exact,
  strings for string inputs, a cast that would change a value refused naming the column); an input that does not
  declare a dtype (a subclassed model) gets the column's own type, floats as floatx, as Keras's numpy adapter
  gives one process; labels keep their type (`columns.label_dtype`), weights become floatx;
* a model Keras has not built (a subclassed model before its first batch) takes one tensor per column (a tuple
  for several) and its labels in its compiled loss's structure (`signature.loss_layout`).

`plan_for_model(model, ...)` / `plan_feeds(signature, ...)` make a `FeedPlan` (every check the schema allows:
counts, kinds, known widths), `FeedPlan.check_ranges` refuses a lossy cast from min/max statistics before a row
is read, and `FeedPlan.convert(record_batch)` gives a `Batch` of numpy arrays; `Batch.element()` is what
`tf.data` and `model.fit` take. Pure Python to import (pyarrow and numpy inside the functions that read data).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stratkit.data import columns as rules
from stratkit.data.columns import Column
from stratkit.data.signature import (
    ModelSignature,
    Port,
    default_layout,
    describe,
    for_tf_data,
    loss_layout,
    pack,
    shape_text,
)
from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Names:
    """How the caller names its arguments, for messages (Spark ML's stages: featuresCols, labelCols, ...)."""

    features: str = "feature_cols"
    labels: str = "label_cols"
    weight: str = "weight_col"


def floatx() -> str:
    """Keras's float type where Keras is loaded (it decides), else float32 (Keras's default)."""
    import sys

    keras = sys.modules.get("keras")
    return str(keras.config.floatx()) if keras is not None else "float32"


def natural_dtype(column: Column) -> str:
    """The dtype a column takes for an input that does not declare one: its own, floats as floatx."""
    return floatx() if column.dtype in rules.EXACT_INTEGERS else column.dtype


@dataclass(frozen=True)
class Feed:
    """The columns that feed one model input, and the input (its `dtype` the one the values take)."""

    port: Port
    columns: tuple[Column, ...]
    names: Names = Names()

    def reshape(self, rows: int, width: int) -> tuple[int, ...]:
        """The shape `rows` rows of `width` values each take for this input; ConfigError if they cannot."""
        shape = list(self.port.shape)
        unknown = [i for i, d in enumerate(shape) if d is None]
        known = math.prod(d for d in shape if d is not None)
        if not unknown and width == known:
            return (rows, *shape)
        if len(unknown) == 1 and known and width % known == 0:
            shape[unknown[0]] = width // known
            return (rows, *shape)
        names = " + ".join(c.name for c in self.columns)
        size = "any number of values" if self.port.size is None else str(self.port.size)
        raise ConfigError(f"{self.names.features} {names!r} give {width} value(s) per row, but the model's input "
                          f"{self.port.name!r} takes shape {shape_text(self.port.shape)} ({size} per row). "
                          f"Fix: feed it columns with {size} values per row (a vector/array column of that length, "
                          "or that many scalar columns), or build the model for this data")

    def values(self, arrays: Sequence[Any]) -> Any:
        """The input's numpy array from its columns' Arrow arrays (each converted by `stratkit.data.columns`)."""
        import numpy as np

        dtype = str(self.port.dtype)
        parts = [rules.to_numpy(array, column, dtype) for array, column in zip(arrays, self.columns)]
        rows = len(parts[0])
        flat = [part.reshape(rows, -1) for part in parts]
        joined = flat[0] if len(flat) == 1 else np.concatenate(flat, axis=1)
        return joined.reshape(self.reshape(rows, joined.shape[1]))


@dataclass(frozen=True)
class Target:
    """The label column of one model output (`port` None: the output is not known yet)."""

    column: Column
    port: Port | None

    @property
    def dtype(self) -> str:
        return rules.label_dtype(self.column)

    def values(self, array: Any) -> Any:
        """The labels as numpy, shaped for the output: its shape when the widths agree, (rows,) for one value."""
        out = rules.to_numpy(array, self.column, self.dtype)
        rows = len(out)
        width = int(out.size // rows) if rows else 1
        shape = self.port.shape if self.port is not None else None
        if shape is not None and all(d is not None for d in shape) and width == max(1, math.prod(shape)):  # type: ignore[arg-type]
            return out.reshape((rows, *shape))  # type: ignore[arg-type]
        return out.reshape(rows) if width == 1 else out.reshape(rows, *out.shape[1:])


@dataclass(frozen=True)
class Batch:
    """One batch for a model: `inputs` and `labels` in the model's own structures, `weights` one per row (None:
    no labels / no weights)."""

    inputs: Any
    labels: Any = None
    weights: Any = None

    def element(self) -> tuple[Any, ...]:
        """`(inputs,)`, `(inputs, labels)` or `(inputs, labels, weights)` with lists as tuples: what `tf.data`
        and Keras's `fit` take (a Python list in a tf.data element would be stacked into one tensor)."""
        parts = [for_tf_data(self.inputs)]
        if self.labels is not None:
            parts.append(for_tf_data(self.labels))
            if self.weights is not None:
                parts.append(self.weights)
        return tuple(parts)


@dataclass(frozen=True)
class FeedPlan:
    """Which columns feed which input, labels to outputs, and the sample weights: made once (`plan_for_model`,
    `plan_feeds`), then applied to every batch (`convert`)."""

    #: The model's signature as fed: every input's dtype the one its values take (a subclassed model's too).
    signature: ModelSignature
    feeds: tuple[Feed, ...]
    targets: tuple[Target, ...] = ()
    weight: Column | None = None
    label_layout: Any = None

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the plan reads (features, labels, weight), each once, in that order."""
        names = [c.name for feed in self.feeds for c in feed.columns] + [t.column.name for t in self.targets]
        names += [self.weight.name] if self.weight is not None else []
        return tuple(dict.fromkeys(names))

    def check_ranges(self, stats: Mapping[str, tuple[Any, Any]]) -> None:
        """Refuse a cast that would change a value, from each column's (smallest, largest) value, before any row
        is read (`columns.check_range`; columns without statistics are checked as their batches are read).

        Raises:
            ConfigError: naming the column, the value and the fix.
        """
        casts = [(c, str(feed.port.dtype)) for feed in self.feeds for c in feed.columns]
        casts += [(self.weight, floatx())] if self.weight is not None else []
        for column, target in casts:
            if column.name in stats and not column.is_string:
                low, high = stats[column.name]
                rules.check_range(column.name, column.dtype, target, low, high)

    def input_values(self, batch: Any) -> list[Any]:
        """The inputs' numpy arrays in `model.inputs` order, from a `pyarrow.RecordBatch` / `Table` or a mapping of
        column name -> Arrow array."""
        return [feed.values([_column(batch, c.name) for c in feed.columns]) for feed in self.feeds]

    def convert(self, batch: Any) -> Batch:
        """One Arrow batch (`pyarrow.RecordBatch`, `Table`, or a mapping of column name -> array) as the model's
        `Batch`: inputs and labels in its structures, weights, all numpy, each column by `stratkit.data.columns`.

        Raises:
            ConfigError: nulls, ragged arrays, a width that fits no input, a value a cast would change.
        """
        inputs = pack(self.signature.input_layout, self.input_values(batch))
        labels = weights = None
        if self.targets:
            labels = pack(self.label_layout, [t.values(_column(batch, t.column.name)) for t in self.targets])
        if self.weight is not None:
            weights = rules.to_numpy(_column(batch, self.weight.name), self.weight, floatx())
        return Batch(inputs, labels, weights)


def _column(batch: Any, name: str) -> Any:
    return batch[name] if isinstance(batch, Mapping) else batch.column(name)


def plan_for_model(model: Any, features: Sequence[Column], labels: Sequence[Column] = (),
                   weight: Column | None = None, names: Names = Names()) -> FeedPlan:
    """`plan_feeds` for a Keras model: its signature (`describe`), or, for a model Keras has not built yet, the
    columns' (one tensor per feature column) and its compiled loss's structure for the labels."""
    signature = describe(model)
    layout = loss_layout(model, len(labels)) if signature is None or not signature.outputs else None
    return plan_feeds(signature, features, labels, weight, names, label_layout=layout)


def plan_feeds(signature: ModelSignature | None, features: Sequence[Column], labels: Sequence[Column] = (),
               weight: Column | None = None, names: Names = Names(), label_layout: Any = None) -> FeedPlan:
    """Which columns feed which input (the module's rule); checks what the schema tells: counts, string/number
    kinds, the widths it knows (the others are checked on the first batch).

    Args:
        signature: the model's (`describe`); None: a model Keras has not built (the columns decide its inputs);
            with `outputs` () the labels decide the outputs.
        features: the feature columns, in the user's order (`columns.column_of` of each field).
        labels: one label column per output (none for scoring).
        weight: a column of per-row sample weights.
        names: how the caller names its arguments, for messages.
        label_layout: the labels' nesting when the outputs are not known (default: one, or a tuple).

    Raises:
        ConfigError: naming the column, the input and the fix.
    """
    if not features:
        raise ConfigError(f"{names.features} names no column. Fix: name the column(s) that feed the model")
    if signature is None:
        ports = tuple(Port(c.name, c.shape or (1,), None) for c in features)
        signature = ModelSignature(ports, (), default_layout(len(ports)))
    inputs = signature.inputs
    if len(inputs) == 1:
        groups = [tuple(features)]
    elif len(features) == len(inputs):
        groups = [(c,) for c in features]
    else:
        raise ConfigError(f"the model has {len(inputs)} inputs ({', '.join(p.name for p in inputs)}) but "
                          f"{names.features} names {len(features)} column(s) ({', '.join(c.name for c in features)})"
                          ". Fix: give one column per input, in the order of model.inputs (assemble several "
                          "columns into one with pyspark.ml.feature.VectorAssembler)")
    feeds = []
    for port, group in zip(inputs, groups):
        dtype = _dtype_for(port, group)
        feed = Feed(Port(port.name, port.shape, dtype), group, names)
        widths = [c.width for c in group]
        if all(w is not None for w in widths):
            feed.reshape(1, sum(w for w in widths if w is not None))
        feeds.append(feed)
    targets, layout = _targets(signature, labels, names, label_layout)
    if weight is not None and (weight.is_string or weight.shape):
        raise ConfigError(f"{names.weight}={weight.name!r} holds {weight.dtype}{' arrays' if weight.shape else ''}, "
                          "not one number per row. Fix: a numeric column of per-row sample weights")
    fed = ModelSignature(tuple(f.port for f in feeds), signature.outputs, signature.input_layout,
                         signature.output_layout if signature.outputs else None)
    return FeedPlan(fed, tuple(feeds), targets, weight, layout)


def _dtype_for(port: Port, group: Sequence[Column]) -> str:
    """The dtype the input's values take: the port's, or (not declared) the columns' own, floats as floatx."""
    what = f"input {port.name!r}"
    if port.dtype is not None:
        for column in group:
            rules.cast_to(column, port.dtype, what)
        return str(port.dtype)
    natural = {natural_dtype(c) for c in group}
    dtype = natural.pop() if len(natural) == 1 else floatx()
    for column in group:
        rules.cast_to(column, dtype, what)
    return dtype


def _targets(signature: ModelSignature, labels: Sequence[Column], names: Names,
             label_layout: Any) -> tuple[tuple[Target, ...], Any]:
    for column in labels:
        if column.is_string:
            raise ConfigError(f"label column {column.name!r} holds strings; Keras's losses take numbers. Fix: index "
                              "the labels first (e.g. pyspark.ml.feature.StringIndexer), one number per class")
    if not labels:
        return (), None
    outputs = signature.outputs
    if not outputs:
        return tuple(Target(c, None) for c in labels), (label_layout if label_layout is not None
                                                        else default_layout(len(labels)))
    if len(labels) != len(outputs):
        raise ConfigError(f"{names.labels}={[c.name for c in labels]} names {len(labels)} column(s) but the model "
                          f"has {len(outputs)} output(s) ({', '.join(p.name for p in outputs)}). Fix: one label "
                          "column per output, in the model's output order")
    return tuple(Target(c, p) for c, p in zip(labels, outputs)), signature.output_layout


__all__ = ["Batch", "Feed", "FeedPlan", "Names", "Target", "floatx", "natural_dtype", "plan_feeds",
           "plan_for_model"]
