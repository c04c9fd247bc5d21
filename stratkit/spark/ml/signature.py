"""Spark ML's side of a model's columns: how the stages name their arguments in messages (`Spelling`), and which
prediction columns a model's outputs become (`output_fields`, `check_classifier`).

What a model takes and gives (`Port`, `ModelSignature`, `describe`) and which columns feed which input, labels to
outputs (`plan_feeds`, `FeedPlan`), are the data layer's, one rule for every engine: `stratkit.data.signature` and
`stratkit.data.feeds`. Each column keeps its own type up to the model's input (`stratkit.data.columns`).

Outputs (`output_fields`): one column per head; a head with one value per
row (shape () or (1,)) is a scalar column (double for floating heads, as
Spark ML's evaluators expect), any other head a flat array column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stratkit.data.feeds import Feed, FeedPlan, Names, plan_feeds
from stratkit.data.signature import ModelSignature, Port, describe, shape_text
from stratkit.errors import ConfigError


@dataclass(frozen=True)
class Spelling(Names):
    """How the caller names the arguments, for messages: the ML stages' params or `keras_predict`'s arguments."""

    features: str = "featuresCols"
    labels: str = "labelCols"
    weight: str = "sampleWeightCol"
    prediction: str = "predictionCol"
    predictions: str = "predictionCols"
    batch: str = "inferenceBatchSize"
    gpu: str = "useGpu"
    kind: str = "predictionKind"
    probability: str = "probabilityCol"


#: The Spark ML stages' spelling (`KerasEstimator`, `KerasModel`).
PARAMS = Spelling()
#: `keras_predict`'s.
ARGUMENTS = Spelling(features="feature_cols", labels="label_cols", weight="weight_col", prediction="prediction_col",
                     predictions="prediction_cols", batch="batch_size", gpu="use_gpu", kind="prediction_kind",
                     probability="probability_col")


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
        """The Spark SQL type (DDL): double/bigint/boolean/string for scalars, array<...> of the head's precision
        else."""
        dtype = str(self.port.dtype)
        if dtype == "string":
            element = "string"
        elif dtype == "bool":
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
        shapes = ", ".join(f"{p.name} {shape_text(p.shape)}" for p in signature.outputs)
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
            raise ConfigError(f"{spelling.predictions}={list(prediction_cols)} names {len(prediction_cols)} column(s) "
                              f"but the model has {len(heads)} output(s) ({', '.join(p.name for p in heads)}). "
                              f"Fix: one name per output, in that order, or leave {spelling.predictions} empty")
        names = list(prediction_cols)
    elif len(heads) == 1:
        names = [prediction_col]
    else:
        names = [f"{prediction_col}_{port.name}" for port in heads]
    if len(set(names)) != len(names):
        raise ConfigError(f"the prediction columns {names} repeat a name. Fix: set {spelling.predictions} to distinct "
                          "names")
    return tuple(OutputField(name, port) for name, port in zip(names, heads))


__all__ = ["ARGUMENTS", "PARAMS", "PREDICTION_KINDS", "Feed", "FeedPlan", "ModelSignature", "OutputField", "Port",
           "Spelling", "check_classifier", "describe", "output_fields", "plan_feeds"]
