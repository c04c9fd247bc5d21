"""A table's rows as a model's batches, flat: the arrays a feed plan gives, cut and gathered by the reader, packed
into the model's structure at the end, and their `tf.TensorSpec`s.

Which column feeds which input is `feeds.py`'s one rule (`plan_for_model`, or `plan_feeds` without a model: one
array for one feature column, a tuple for several); this module only lays a batch out flat, so the reader can
gather, cut and split rows with one numpy operation per array, and a `tf.data` pipeline can carry them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from stratkit.data import columns as rules
from stratkit.data.columns import Column
from stratkit.data.feeds import FeedPlan, Names, floatx, plan_feeds, plan_for_model
from stratkit.data.signature import for_tf_data, pack
from stratkit.errors import ConfigError

#: How `TableInput` names its arguments in messages.
NAMES = Names(features="features", labels="label", weight="sample_weight")


@dataclass(frozen=True)
class Slot:
    """One flat array of a batch: its dtype and per-row shape."""

    dtype: str
    shape: tuple[int, ...]


class Batcher:
    """A feed plan's batch as flat arrays: inputs (in `model.inputs` order), the label, the sample weight."""

    def __init__(self, columns: Sequence[Column], features: str | Sequence[str], label: str | None = None,
                 sample_weight: str | None = None, model: Any = None) -> None:
        by_name = {c.name: c for c in columns}
        names = [features] if isinstance(features, str) else list(features)
        for name in [*names, *(n for n in (label, sample_weight) if n is not None)]:
            if name not in by_name:
                raise ConfigError(f"column {name!r} is not in the table (its columns: {sorted(by_name)}). Fix: "
                                  "features=/label=/sample_weight= must name columns of the table")
        if label is not None and label in names:
            raise ConfigError(f"label={label!r} is also in features={names!r}. Fix: remove it from the features")
        feats = [_known(by_name[n]) for n in names]
        labels = [_known(by_name[label])] if label is not None else []
        weight = by_name[sample_weight] if sample_weight is not None else None
        self.plan: FeedPlan = (plan_for_model(model, feats, labels, weight, NAMES) if model is not None
                               else plan_feeds(None, feats, labels, weight, NAMES))
        slots = []
        for feed in self.plan.feeds:
            width = sum(c.width or 0 for c in feed.columns)
            slots.append(Slot(str(feed.port.dtype), tuple(int(d) for d in feed.reshape(1, width)[1:])))
        for target in self.plan.targets:
            slots.append(Slot(target.dtype, _label_shape(target)))
        if weight is not None:
            slots.append(Slot(floatx(), ()))
        self.slots = slots
        self.inputs = len(self.plan.feeds)

    @property
    def read_columns(self) -> list[str]:
        """Every column a batch needs, each once."""
        return list(self.plan.columns)

    def check_bounds(self, bounds: dict[str, tuple[Any, Any]]) -> None:
        """Refuse a cast the table's statistics show would change a value (before a row is read)."""
        self.plan.check_ranges({k: v for k, v in bounds.items() if v != (None, None)})

    def arrays(self, table: Any) -> list[Any]:
        """The batch's flat arrays from an Arrow table of rows (each column by `stratkit.data.columns`).

        Raises:
            ConfigError: nulls, a value a cast would change, a row of an array column of another length.
        """
        out = self.plan.input_values(table)
        out += [t.values(table.column(t.column.name)) for t in self.plan.targets]
        if self.plan.weight is not None:
            out.append(rules.to_numpy(table.column(self.plan.weight.name), self.plan.weight, floatx()))
        rows = table.num_rows
        for i, (value, slot) in enumerate(zip(out, self.slots)):
            if value.shape[1:] != slot.shape:
                try:
                    out[i] = value.reshape((rows, *slot.shape))
                except ValueError:
                    raise ConfigError(f"a batch of the table gives {value.size // max(rows, 1)} value(s) per row "
                                      f"where its first row gave {math.prod(slot.shape)}. Fix: give every row of "
                                      "an array column the same length") from None
        return out

    def pack(self, arrays: Sequence[Any]) -> tuple:
        """Flat arrays (or tensors) as Keras takes a batch: `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
        plan = self.plan
        parts = [for_tf_data(pack(plan.signature.input_layout, list(arrays[:self.inputs])))]
        if plan.targets:
            parts.append(for_tf_data(pack(plan.label_layout, list(arrays[self.inputs:self.inputs
                                                                          + len(plan.targets)]))))
            if plan.weight is not None:
                parts.append(arrays[-1])
        return tuple(parts)

    def specs(self) -> tuple:
        """The `tf.TensorSpec`s of a batch (batch dimension None), packed like `pack`."""
        import tensorflow as tf

        return self.pack([tf.TensorSpec((None, *s.shape), tf.string if s.dtype == rules.STRING
                                        else tf.dtypes.as_dtype(s.dtype)) for s in self.slots])

    def empty(self) -> list[Any]:
        import numpy as np

        return [np.zeros((0, *s.shape), object if s.dtype == rules.STRING else s.dtype) for s in self.slots]


def _label_shape(target: Any) -> tuple[int, ...]:
    """The per-row shape `feeds.Target.values` gives its labels."""
    width = target.column.width or 1
    shape = target.port.shape if target.port is not None else None
    if shape is not None and all(d is not None for d in shape) and width == max(1, math.prod(shape)):
        return tuple(int(d) for d in shape)
    return () if width == 1 else tuple(int(d) for d in target.column.shape)


def _known(column: Column) -> Column:
    if column.width is None:
        raise ConfigError(f"column {column.name!r} holds arrays whose length the schema does not fix ("
                          f"{column.dtype} shape {column.shape}). Fix: write it as a fixed-size list "
                          "(pyarrow.list_(type, length)), so every row has the same length")
    return column


__all__ = ["NAMES", "Batcher", "Slot"]
