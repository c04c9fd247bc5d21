"""What a Keras model takes and gives, per row: its inputs and outputs (`Port`s), in which structure, shapes and
dtypes (`ModelSignature`), read from a model by `describe`.

The structure is a *layout*: the model's own nesting (a single tensor, a list, a tuple, a dict, or a mix) with
each tensor replaced by its position in `model.inputs` (the order `keras.tree.flatten` gives: a dict's keys
sorted). `pack(layout, values)` puts values back into that nesting, so a list model gets a list, a tuple model a
tuple and a dict model a dict keyed as it was built. `for_tf_data` turns the lists into tuples: tf.data stacks a
Python list into one tensor (a list of a 64-wide and a 1-wide input fails there: issue 49), and Keras takes a tuple
wherever it takes a list of inputs.

A model Keras has not built (a subclassed model before its first batch) says nothing: `describe` returns None and
the columns decide (`stratkit.data.feeds`). A built subclassed model says its input shapes (its build config) but
not their dtypes: its ports' `dtype` is None, which the feeds read as "the column's own type, floats as floatx",
what Keras's numpy adapter gives one process.

Pure Python to import; `describe` imports Keras.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Port:
    """One model input or output: its name, per-row shape (no batch dimension) and dtype (None: not declared)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str | None

    @property
    def size(self) -> int | None:
        """Values per row (None when a dimension is unknown)."""
        if any(d is None for d in self.shape):
            return None
        return math.prod(self.shape)  # type: ignore[arg-type]  # () -> 1

    @property
    def scalar(self) -> bool:
        return self.size == 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Port:
        dtype = data.get("dtype")
        return cls(str(data["name"]), tuple(None if d is None else int(d) for d in data["shape"]),
                   None if dtype is None else str(dtype))


# -- layouts: the model's nesting, with each tensor's position --------------------------------------

def default_layout(count: int) -> Any:
    """One tensor for one port, a tuple for several (the structure when the model does not say)."""
    return 0 if count == 1 else tuple(range(count))


def layout_of(structure: Any, is_leaf: Any) -> tuple[Any, list[tuple[Any, Any]]]:
    """(the layout of a nested structure, its leaves as `(key or None, leaf)` in `keras.tree.flatten`'s order)."""
    leaves: list[tuple[Any, Any]] = []

    def walk(node: Any, key: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(node[k], k) for k in sorted(node)}
        if isinstance(node, (list, tuple)) and not is_leaf(node):
            items = [walk(item, None) for item in node]
            return tuple(items) if isinstance(node, tuple) else items
        leaves.append((key, node))
        return len(leaves) - 1

    return walk(structure, None), leaves


def pack(layout: Any, values: Sequence[Any]) -> Any:
    """`values` (one per port, in port order) in the layout's nesting."""
    if isinstance(layout, dict):
        return {key: pack(item, values) for key, item in layout.items()}
    if isinstance(layout, (list, tuple)):
        items = [pack(item, values) for item in layout]
        return tuple(items) if isinstance(layout, tuple) else items
    return values[layout]


def for_tf_data(structure: Any) -> Any:
    """The structure with every list a tuple (tf.data stacks a list into one tensor; Keras reads a tuple alike)."""
    if isinstance(structure, dict):
        return {key: for_tf_data(value) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return tuple(for_tf_data(value) for value in structure)
    return structure


def kind(layout: Any) -> str:
    """"single", "list", "tuple" or "dict": how the model takes (or gives) its tensors."""
    return {dict: "dict", list: "list", tuple: "tuple"}.get(type(layout), "single")


def _layout_json(layout: Any) -> Any:
    if isinstance(layout, dict):
        return {"dict": [[key, _layout_json(value)] for key, value in layout.items()]}
    if isinstance(layout, (list, tuple)):
        return {kind(layout): [_layout_json(value) for value in layout]}
    return int(layout)


def _layout_from_json(data: Any) -> Any:
    if isinstance(data, dict):
        (name, items), = data.items()
        if name == "dict":
            return {str(key): _layout_from_json(value) for key, value in items}
        values = [_layout_from_json(value) for value in items]
        return tuple(values) if name == "tuple" else values
    return int(data)


@dataclass(frozen=True)
class ModelSignature:
    """A model's inputs (in `model.inputs` order) and outputs (in `keras.tree.flatten` order of its outputs), with
    the layouts that nest them; `outputs` is () while they are not known (a model Keras has not built)."""

    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    #: The inputs' and outputs' nesting (see `pack`); None: one tensor for one port, a list for several.
    input_layout: Any = None
    output_layout: Any = None

    def __post_init__(self) -> None:
        for name, ports in (("input_layout", self.inputs), ("output_layout", self.outputs)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, 0 if len(ports) == 1 else list(range(len(ports))))

    @property
    def input_structure(self) -> str:
        return kind(self.input_layout)

    @property
    def output_structure(self) -> str:
        return kind(self.output_layout)

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [p.to_json() for p in self.inputs], "outputs": [p.to_json() for p in self.outputs],
                "input_layout": _layout_json(self.input_layout), "output_layout": _layout_json(self.output_layout)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSignature:
        """Read `to_json`'s dict; also the older one with "input_structure" ("list" or "dict") instead of layouts."""
        inputs = tuple(Port.from_json(p) for p in data["inputs"])
        outputs = tuple(Port.from_json(p) for p in data["outputs"])
        layouts = []
        for key, ports in (("input", inputs), ("output", outputs)):
            if f"{key}_layout" in data:
                layouts.append(_layout_from_json(data[f"{key}_layout"]))
            elif data.get(f"{key}_structure") == "dict":
                layouts.append({port.name: i for i, port in enumerate(ports)})
            else:
                layouts.append(None)
        return cls(inputs, outputs, layouts[0], layouts[1])


# -- reading a model --------------------------------------------------------------------------------

def describe(model: Any, fed: ModelSignature | None = None) -> ModelSignature | None:
    """The signature of a Keras model: a functional or Sequential model's from its symbolic inputs (dtypes as
    declared), a built subclassed model's from its build config (dtypes from `fed`, the signature it was fed by,
    else None); None for a model Keras has not built.

    Raises:
        ConfigError: a model whose outputs Keras cannot compute from those inputs, or one called with several
            arguments.
    """
    import keras

    symbolic = _symbolic(model)
    if symbolic is not None:
        layout, leaves = symbolic
        inputs = [Port(_input_name(key, tensor, i), tuple(tensor.shape[1:]), str(tensor.dtype))
                  for i, (key, tensor) in enumerate(leaves)]
    else:
        config = model.get_build_config() if getattr(model, "built", False) else None
        if not config or "input_shape" not in config:
            if config:
                raise ConfigError(f"the {type(model).__name__} model was built with several call arguments "
                                  f"({', '.join(config.get('shapes_dict', {}))}). Fix: take every input in its "
                                  "call's first argument (a tensor, list, tuple or dict of them)")
            return None
        layout, leaves = layout_of(_shapes(config["input_shape"]), _is_shape)
        given = fed.inputs if fed is not None and len(fed.inputs) == len(leaves) else None
        inputs = [Port(str(key) if key is not None else (given[i].name if given else f"input_{i}"),
                       tuple(shape[1:]), given[i].dtype if given else None) for i, (key, shape) in enumerate(leaves)]
    tensors = [keras.KerasTensor((None, *port.shape), dtype=port.dtype or keras.config.floatx(), name=port.name)
               for port in inputs]
    try:
        spec = model.compute_output_spec(pack(layout, tensors)) if symbolic is None else model.output
    except Exception as exc:  # noqa: BLE001 - what Keras says, as a ConfigError naming the model
        raise ConfigError(f"cannot tell what the {type(model).__name__} model gives for inputs "
                          f"{[(p.name, p.shape, p.dtype) for p in inputs]}: {type(exc).__name__}: {exc}. Fix: "
                          "build it with keras.Input(...) (a functional model)") from None
    out_layout, out_leaves = layout_of(spec, lambda node: False)
    given_names = list(getattr(model, "output_names", None) or [])
    outputs = [Port(str(key) if key is not None else
                    (given_names[i] if len(given_names) == len(out_leaves) else f"output_{i}"),
                    tuple(tensor.shape[1:]), str(tensor.dtype)) for i, (key, tensor) in enumerate(out_leaves)]
    if not inputs:
        raise ConfigError(f"the {type(model).__name__} model has no inputs. Fix: build it with keras.Input(...)")
    return ModelSignature(tuple(inputs), tuple(outputs), layout, out_layout)


def _symbolic(model: Any) -> tuple[Any, list[tuple[Any, Any]]] | None:
    """(the input layout, its tensors) of a functional or Sequential model; None for a subclassed one."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    try:
        structure = model.input
    except (AttributeError, ValueError):  # a Sequential model that was never called: one input
        structure = inputs[0] if len(inputs) == 1 else inputs
    if getattr(model, "output", None) is None:
        return None
    return layout_of(structure, lambda node: False)


def _input_name(key: Any, tensor: Any, index: int) -> str:
    """A dict input's key (what the model is fed by), else the tensor's name."""
    return str(key) if key is not None else str(getattr(tensor, "name", None) or f"input_{index}")


def _is_shape(node: Any) -> bool:
    return isinstance(node, (list, tuple)) and all(d is None or isinstance(d, int) for d in node)


def _shapes(structure: Any) -> Any:
    """A build config's shapes with every shape a tuple (JSON made some lists)."""
    if _is_shape(structure):
        return tuple(structure)
    if isinstance(structure, dict):
        return {key: _shapes(value) for key, value in structure.items()}
    return type(structure)(_shapes(value) for value in structure)


def loss_layout(model: Any, count: int) -> Any:
    """The nesting of a model's labels as its compiled loss has it, for a model whose outputs are not known yet:
    a dict of losses takes a dict of labels (keys sorted, as Keras flattens them), else one label or a tuple."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, dict) and len(loss) == count:
        return {key: i for i, key in enumerate(sorted(loss))}
    return default_layout(count)


def shape_text(shape: Sequence[int | None]) -> str:
    """A per-row shape as Python writes a tuple: (3,), (8, 8, 1), ()."""
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


__all__ = ["ModelSignature", "Port", "default_layout", "describe", "for_tf_data", "kind", "layout_of", "loss_layout",
           "pack", "shape_text"]
