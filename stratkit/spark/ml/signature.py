"""What a Keras model takes and gives, per row, and which DataFrame columns feed which of its inputs.

Pure Python (no pyspark; TensorFlow only inside `describe`, which reads a
loaded model), so the driver can check a DataFrame against a model it never
loaded: a fitted `KerasModel` carries its `ModelSignature` (written by the
chief after training and saved with it), and `keras_predict` describes a
model file once.

The one rule for columns -> inputs (`plan_inputs`), used by training and by
inference alike:
  * a model with one input takes every feature column, side by side in the
    order given (a scalar column is one value, an array or vector column its
    length), reshaped to the input's per-row shape: 64 values feed an input
    of shape (8, 8, 1);
  * a model with N > 1 inputs takes one column per input, in the order of
    `model.inputs`;
  * the values per row must equal the input's size; a column whose width the
    schema does not say (an array column, a vector without Spark ML size
    metadata) is checked on its first batch, in the task.

Outputs (`output_fields`): one column per head; a head with one value per
row (shape () or (1,)) is a scalar column (double for floating heads, as
Spark ML's evaluators expect), any other head a flat array column.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stratkit.errors import ConfigError

#: Model input dtypes a numeric column can feed.
NUMERIC_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


@dataclass(frozen=True)
class Spelling:
    """How the caller names the arguments, for messages: the ML stages' params or `keras_predict`'s arguments."""

    features: str = "featuresCols"
    prediction: str = "predictionCol"
    predictions: str = "predictionCols"
    batch: str = "inferenceBatchSize"
    gpu: str = "useGpu"
    kind: str = "predictionKind"
    probability: str = "probabilityCol"


#: The Spark ML stages' spelling (`KerasEstimator`, `KerasModel`).
PARAMS = Spelling()
#: `keras_predict`'s.
ARGUMENTS = Spelling("feature_cols", "prediction_col", "prediction_cols", "batch_size", "use_gpu", "prediction_kind",
                     "probability_col")


@dataclass(frozen=True)
class Port:
    """One model input or output: its name, per-row shape (no batch dimension) and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    @property
    def size(self) -> int | None:
        """Values per row (None when a dimension is unknown)."""
        if any(d is None for d in self.shape):
            return None
        return math.prod(self.shape)  # () -> 1

    @property
    def scalar(self) -> bool:
        return self.size == 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Port:
        return cls(str(data["name"]), tuple(None if d is None else int(d) for d in data["shape"]), str(data["dtype"]))


@dataclass(frozen=True)
class ModelSignature:
    """A model's inputs (in `model.inputs` order) and outputs (in the order `keras.tree.flatten` gives them)."""

    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    #: "list" or "dict": how the model takes several inputs (a functional model built on a dict of Inputs) and
    #: gives several outputs (a dict's are in sorted key order, as `keras.tree.flatten` gives them).
    input_structure: str = "list"
    output_structure: str = "list"

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [p.to_json() for p in self.inputs], "outputs": [p.to_json() for p in self.outputs],
                "input_structure": self.input_structure, "output_structure": self.output_structure}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSignature:
        return cls(tuple(Port.from_json(p) for p in data["inputs"]), tuple(Port.from_json(p) for p in data["outputs"]),
                   str(data.get("input_structure", "list")), str(data.get("output_structure", "list")))


def describe(model: Any) -> ModelSignature:
    """The signature of a built Keras model (functional, Sequential, or a subclassed model that was built)."""
    import keras

    symbolic = _symbolic_inputs(model)
    if symbolic is not None:
        inputs, structure = symbolic
    else:  # a subclassed model: its build shape says what it takes
        config = model.get_build_config() if hasattr(model, "get_build_config") else None
        shape = (config or {}).get("input_shape")
        if not shape or isinstance(shape[0], (list, tuple, dict)):
            raise ConfigError(f"cannot tell what the {type(model).__name__} model takes: it has no symbolic inputs "
                              "and no single input shape. Fix: build it with keras.Input(...) (a functional or "
                              "Sequential model), or call it once on a batch before saving it")
        inputs = [keras.KerasTensor(tuple(shape), dtype="float32", name="input")]
        structure = "list"
    if not inputs:
        raise ConfigError(f"the {type(model).__name__} model has no inputs. Fix: build it with keras.Input(...)")
    arguments = (dict(zip([_name(t, i) for i, t in enumerate(inputs)], inputs)) if structure == "dict"
                 else inputs if len(inputs) > 1 else inputs[0])
    spec = model.compute_output_spec(arguments)
    flat = keras.tree.flatten(spec)
    if isinstance(spec, dict):
        names = sorted(spec)  # keras.tree.flatten's order for a dict
    else:
        given = list(getattr(model, "output_names", None) or [])
        names = given if len(given) == len(flat) else [f"output_{i}" for i in range(len(flat))]
    ports_in = tuple(Port(_name(t, i), tuple(t.shape[1:]), str(t.dtype)) for i, t in enumerate(inputs))
    ports_out = tuple(Port(str(n), tuple(t.shape[1:]), str(t.dtype)) for n, t in zip(names, flat))
    return ModelSignature(ports_in, ports_out, structure, "dict" if isinstance(spec, dict) else "list")


def _symbolic_inputs(model: Any) -> tuple[list[Any], str] | None:
    """The model's input tensors and how it takes them ("list" or "dict"); None for a subclassed model."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        return None
    try:
        structure = "dict" if isinstance(model.input, dict) else "list"
    except (AttributeError, ValueError):  # a Sequential model that was never called: one input
        structure = "list"
    return inputs, structure


def _name(tensor: Any, index: int) -> str:
    return str(getattr(tensor, "name", None) or f"input_{index}")


@dataclass(frozen=True)
class Feed:
    """The columns that feed one model input, their widths (None: known at the first batch) and the input."""

    port: Port
    columns: tuple[str, ...]
    widths: tuple[int | None, ...]
    spelling: Spelling = PARAMS

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
        names = " + ".join(self.columns)
        raise ConfigError(f"{self.spelling.features} {names!r} give {width} value(s) per row, but the model's input "
                          f"{self.port.name!r} takes shape {_shape(self.port.shape)} ({_size(self.port)} per row). "
                          f"Fix: feed it columns with {_size(self.port)} values per row (a vector/array column of "
                          "that length, or that many scalar columns), or build the model for this data")


def _shape(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _size(port: Port) -> str:
    return "any number of values" if port.size is None else str(port.size)


def plan_inputs(signature: ModelSignature, columns: Sequence[tuple[str, int | None]],
                spelling: Spelling = PARAMS) -> tuple[Feed, ...]:
    """Which columns feed which input (see the module docstring); checks every width the schema knows.

    Args:
        signature: the model's.
        columns: `(name, values per row or None)` for each feature column, in the user's order.
        spelling: how the caller names its arguments, for messages.

    Raises:
        ConfigError: naming the column, the input and the fix.
    """
    inputs = signature.inputs
    for port in inputs:
        if port.dtype not in NUMERIC_DTYPES:
            raise ConfigError(f"the model's input {port.name!r} takes {port.dtype} values; stratkit feeds numeric "
                              "columns only. Fix: turn the column into numbers in the DataFrame (e.g. with "
                              "pyspark.ml.feature.StringIndexer), and build the model on those")
    if len(inputs) == 1:
        feeds = (Feed(inputs[0], tuple(c for c, _ in columns), tuple(w for _, w in columns), spelling),)
    elif len(columns) == len(inputs):
        feeds = tuple(Feed(port, (name,), (width,), spelling) for port, (name, width) in zip(inputs, columns))
    else:
        raise ConfigError(f"the model has {len(inputs)} inputs ({', '.join(p.name for p in inputs)}) but {spelling.features} "
                          f"names {len(columns)} column(s) ({', '.join(c for c, _ in columns)}). Fix: give one column "
                          "per input, in the order of model.inputs (assemble several columns into one with "
                          "pyspark.ml.feature.VectorAssembler)")
    for feed in feeds:
        if all(w is not None for w in feed.widths):
            feed.reshape(1, sum(w for w in feed.widths if w is not None))
    return feeds


@dataclass(frozen=True)
class OutputField:
    """One prediction column: the head it holds, and whether it is a scalar or a flat array."""

    column: str
    port: Port

    @property
    def scalar(self) -> bool:
        return self.port.scalar

    @property
    def spark_type(self) -> str:
        """The Spark SQL type (DDL): double/bigint/boolean for scalars, array<...> of the head's precision else."""
        dtype = self.port.dtype
        if dtype == "bool":
            element = "boolean"
        elif dtype.startswith(("int", "uint")):
            element = "bigint" if self.scalar or dtype in ("int64", "uint32", "uint64") else "int"
        elif self.scalar or dtype == "float64":
            element = "double"  # Spark ML's evaluators take double predictions (BinaryClassificationEvaluator: only)
        else:
            element = "float"
        return element if self.scalar else f"array<{element}>"


#: What the prediction columns hold: each head's values ("raw"), or a classifier's class index and probabilities.
PREDICTION_KINDS = ("raw", "class")


def check_classifier(signature: ModelSignature, kind: str, spelling: Spelling = PARAMS) -> None:
    """`kind="class"` needs one head of one value (a sigmoid: P(class 1)) or one value per class (a softmax)."""
    if kind not in PREDICTION_KINDS:
        raise ConfigError(f"{spelling.kind}={kind!r} is not one of {list(PREDICTION_KINDS)}. Fix: 'raw' for the "
                          "model's outputs as they are, 'class' for a classifier's class index and probabilities")
    if kind == "class" and (len(signature.outputs) != 1 or len(signature.outputs[0].shape) > 1
                            or signature.outputs[0].size is None):
        shapes = ", ".join(f"{p.name} {_shape(p.shape)}" for p in signature.outputs)
        raise ConfigError(f"{spelling.kind}='class' needs a model with one output of one value per row (a sigmoid) "
                          f"or one value per class (a softmax); this model gives {shapes}. Fix: "
                          f"{spelling.kind}='raw'")


def output_fields(signature: ModelSignature, prediction_col: str, prediction_cols: Sequence[str] = (),
                  spelling: Spelling = PARAMS) -> tuple[OutputField, ...]:
    """The prediction columns: `prediction_col` for a one-head model; for N heads `prediction_cols` (N names) or
    `<prediction_col>_<head name>`."""
    heads = signature.outputs
    if prediction_cols:
        if len(prediction_cols) != len(heads):
            raise ConfigError(f"{spelling.predictions}={list(prediction_cols)} names {len(prediction_cols)} column(s) but the "
                              f"model has {len(heads)} output(s) ({', '.join(p.name for p in heads)}). Fix: one "
                              f"name per output, in that order, or leave {spelling.predictions} empty")
        names = list(prediction_cols)
    elif len(heads) == 1:
        names = [prediction_col]
    else:
        names = [f"{prediction_col}_{port.name}" for port in heads]
    if len(set(names)) != len(names):
        raise ConfigError(f"the prediction columns {names} repeat a name. Fix: set {spelling.predictions} to distinct "
                          "names")
    return tuple(OutputField(name, port) for name, port in zip(names, heads))
