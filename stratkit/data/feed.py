"""Which columns feed which model input, and an Arrow table of rows turned into (x, y, sample_weight) arrays.

The rule (the same as Spark ML's, `stratkit/spark/ml/signature.py`):

* without a model: one feature column gives `x` as its array, several give a dict by name, each in its own
  dtype (`columns.py`);
* a model with one input takes every feature column side by side (a scalar column one value per row, an
  array column its length), reshaped to the input's per-row shape, cast to its dtype;
* a model with several inputs takes one column per input: by name when the feature names are the inputs'
  names, else in the order of `model.inputs`; a model built on a dict of inputs gets a dict.

Every cast goes through `columns.cast_to` / `columns.to_numpy` (never a cast that loses a value), and is
checked against the table's min/max statistics before a row is read (`Feed.check_bounds`). Labels and sample
weights keep their own dtype (`columns.label_dtype`).

Interim: the typed-columns work moves this mapping into `stratkit/data/signature.py`; this module then keeps
only what the table reader adds (batches as flat lists, the TensorSpecs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stratkit.data import columns as col
from stratkit.data.columns import Column
from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Port:
    """One model input: its name, per-row shape and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str


def model_inputs(model: Any) -> tuple[list[Port], str] | None:
    """The model's inputs (in `model.inputs` order) and "list" or "dict"; None when it has no symbolic inputs."""
    try:
        tensors = list(model.inputs)
    except (AttributeError, ValueError):
        return None
    if not tensors:
        return None
    try:
        structure = "dict" if isinstance(model.input, dict) else "list"
    except (AttributeError, ValueError):
        structure = "list"
    names = list(model.input.keys()) if structure == "dict" else [
        str(getattr(t, "name", None) or f"input_{i}") for i, t in enumerate(tensors)]
    ports = [Port(n, tuple(t.shape[1:]), col.float_name(t.dtype)) for n, t in zip(names, tensors)]
    return ports, structure


@dataclass(frozen=True)
class Slot:
    """One array of a batch: the columns it joins, its dtype and per-row shape."""

    columns: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]


class Feed:
    """The arrays a batch of rows becomes: `x` (one array, a list or a dict), the label, the sample weight."""

    def __init__(self, columns: Sequence[Column], features: str | Sequence[str], label: str | None = None,
                 sample_weight: str | None = None, model: Any = None) -> None:
        by_name = {c.name: c for c in columns}
        names = [features] if isinstance(features, str) else list(features)
        if not names:
            raise ConfigError("features= names no column. Fix: e.g. features=['x'] or features='pixels'")
        for name in [*names, *(n for n in (label, sample_weight) if n is not None)]:
            if name not in by_name:
                raise ConfigError(f"column {name!r} is not in the table (its columns: {sorted(by_name)}). Fix: "
                                  "features=/label=/sample_weight= must name columns of the table")
        if label is not None and label in names:
            raise ConfigError(f"label={label!r} is also in features={names!r}. Fix: remove it from the features")
        self.names = names
        self.label = label
        self.sample_weight = sample_weight
        described = model_inputs(model) if model is not None else None
        self.structure, self.keys, slots = self._map(by_name, names, features, described)
        for name in (label, sample_weight):
            if name is not None:
                column = by_name[name]
                _known(column)
                slots.append(Slot((name,), col.label_dtype(column), tuple(int(d) for d in column.shape)))
        self.slots = slots
        self.by_name = by_name

    @staticmethod
    def _map(by_name: dict[str, Column], names: list[str], features: Any,
             described: tuple[list[Port], str] | None) -> tuple[str, list[str], list[Slot]]:
        if described is None:
            slots = [Slot((n,), by_name[n].dtype, tuple(int(d) for d in _known(by_name[n]).shape)) for n in names]
            return ("single" if isinstance(features, str) else "dict"), names, slots
        ports, structure = described
        if len(ports) == 1:
            port = ports[0]
            for name in names:
                col.cast_to(by_name[name], port.dtype, f"input {port.name!r}")
            width = sum(_known(by_name[n]).width or 0 for n in names)
            return "single", [port.name], [Slot(tuple(names), col.cast_to(by_name[names[0]], port.dtype),
                                               _shape(port, width, names))]
        if len(names) != len(ports):
            raise ConfigError(f"the model has {len(ports)} inputs ({', '.join(p.name for p in ports)}) but "
                              f"features= names {len(names)} column(s) ({', '.join(names)}). Fix: one column per "
                              "input, in the order of model.inputs (or named as the inputs)")
        if set(names) == {p.name for p in ports}:
            names = [p.name for p in ports]
        slots = []
        for port, name in zip(ports, names):
            column = _known(by_name[name])
            slots.append(Slot((name,), col.cast_to(column, port.dtype, f"input {port.name!r}"),
                              _shape(port, column.width or 0, [name])))
        return ("dict" if structure == "dict" else "list"), [p.name for p in ports], slots

    @property
    def read_columns(self) -> list[str]:
        """Every column a batch needs, in a fixed order."""
        out: list[str] = []
        for slot in self.slots:
            out += [c for c in slot.columns if c not in out]
        return out

    def check_bounds(self, bounds: dict[str, tuple[Any, Any]]) -> None:
        """Refuse a cast the table's statistics show would change a value (before a row is read)."""
        for slot in self.slots:
            for name in slot.columns:
                low, high = bounds.get(name, (None, None))
                column = self.by_name[name]
                if not column.is_string:
                    col.check_range(name, column.dtype, slot.dtype, low, high)

    def arrays(self, table: Any) -> list[Any]:
        """The batch's arrays (flat: x's slots, then label, then sample weight) from an Arrow table of rows."""
        import numpy as np

        out = []
        rows = table.num_rows
        for slot in self.slots:
            parts = [col.to_numpy(table.column(n), self.by_name[n], slot.dtype if slot.dtype != col.STRING
                                  else col.STRING) for n in slot.columns]
            if len(parts) == 1:
                value = parts[0]
            else:
                value = np.concatenate([p.reshape(rows, -1) for p in parts], axis=1)
            try:
                out.append(value.reshape((rows, *slot.shape)))
            except ValueError:
                raise ConfigError(f"column(s) {' + '.join(slot.columns)} give {value.size // max(rows, 1)} value(s) "
                                  f"per row here, not the {math.prod(slot.shape)} of their first row. Fix: give "
                                  "every row of an array column the same length") from None
        return out

    def pack(self, arrays: Sequence[Any]) -> tuple:
        """The flat arrays as Keras takes a batch: (x,), (x, y) or (x, y, sample_weight)."""
        count = len(self.keys) if self.structure != "single" else 1
        xs = list(arrays[:count])
        x: Any = xs[0] if self.structure == "single" else (dict(zip(self.keys, xs)) if self.structure == "dict"
                                                           else tuple(xs))
        rest = list(arrays[count:])
        return (x, *rest)

    def specs(self) -> tuple:
        """The `tf.TensorSpec`s of a batch (batch dimension None), packed like `pack`."""
        import tensorflow as tf

        flat = [tf.TensorSpec((None, *s.shape), tf.string if s.dtype == col.STRING else tf.dtypes.as_dtype(
            s.dtype)) for s in self.slots]
        return self.pack(flat)


def _known(column: Column) -> Column:
    if column.width is None:
        raise ConfigError(f"column {column.name!r} holds arrays whose length the schema does not fix ("
                          f"{column.dtype} shape {column.shape}). Fix: write it as a fixed-size list "
                          "(pyarrow.list_(type, length)), so every row has the same length")
    return column


def _shape(port: Port, width: int, names: Sequence[str]) -> tuple[int, ...]:
    shape = list(port.shape)
    unknown = [i for i, d in enumerate(shape) if d is None]
    known = math.prod(d for d in shape if d is not None)
    if not unknown and width == known:
        return tuple(int(d) for d in shape)
    if len(unknown) == 1 and known and width % known == 0:
        shape[unknown[0]] = width // known
        return tuple(int(d) for d in shape)
    raise ConfigError(f"features {' + '.join(names)!r} give {width} value(s) per row, but the model's input "
                      f"{port.name!r} takes shape {tuple(port.shape)} ({known if not unknown else 'any number'} per "
                      "row). Fix: feed it columns with that many values per row, or build the model for this data")


Converter = Callable[[Any], list[Any]]

__all__ = ["Feed", "Port", "Slot", "model_inputs"]
