"""Batch inference on the executors, driver side: check the DataFrame against the model, then one Arrow UDF.

`keras_predict(df, "model.keras", feature_cols=[...])` scores any saved Keras
model; `KerasModel.transform` is the same call on its fitted model. Before
any Spark job:
  * the model file is read and checked (`model_files.read_model`: a file that
    is not a Keras 3 `.keras` file is a `ConfigError` naming it), and loaded
    once on the driver to learn its signature (`signature.describe`; a fitted
    `KerasModel` carries it, so its transform imports no TensorFlow here);
  * every feature column must exist and hold numbers, strings, arrays of
    them or Spark ML vectors, of the kind its input takes (a string column
    for a string input); a vector's size (from its ML attribute metadata, as
    VectorAssembler and StandardScaler write it) and a scalar's must fit the
    model's input (`stratkit.data.feeds.plan_feeds`); the prediction columns
    must be new; `use_gpu` needs `spark.task.resource.gpu.amount`.
Each column reaches the model in its own type, cast to its input's dtype by
`stratkit.data.columns`: int64 ids stay exact for an int64 input, and a cast
that would change a value (an id above 2^24 into float32) is a `ConfigError`
naming the column when its batch is read on the executor. Widths the schema
cannot tell (array columns, vectors without metadata) are checked on each
task's first batch, with the same message.

The UDF is an iterator Arrow UDF (`pyspark.sql.functions.arrow_udf`, pyspark
4.1 and later): Arrow columns in, Arrow columns out, no pandas and no
per-row Python step; on older pyspark a pandas iterator UDF around the same
code. One UDF returns every head (a struct when there are several), which the
DataFrame then spreads over the prediction columns.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from stratkit.data.columns import Column
from stratkit.data.feeds import plan_feeds
from stratkit.data.signature import ModelSignature, describe
from stratkit.errors import ConfigError
from stratkit.spark import staging
from stratkit.spark.ml import model_files
from stratkit.spark.ml.predictor import InferenceSpec, predict_batches
from stratkit.spark.ml.signature import ARGUMENTS, PARAMS, Spelling, check_classifier, output_fields

#: Rows per model call unless the caller says otherwise (Arrow batches are joined or cut to it).
DEFAULT_BATCH_SIZE = 1024
#: Use the Arrow UDF where pyspark has one (tests turn it off to run the pandas path).
PREFER_ARROW = True

_signatures: dict[str, ModelSignature] = {}
_signatures_lock = threading.Lock()


def model_signature(model: bytes, where: str, custom_objects: dict[str, Any] | None = None,
                    safe_mode: bool = True) -> ModelSignature:
    """Load `model` (the bytes of a .keras file) on the driver once and describe it; cached by content.

    Raises:
        ConfigError: Keras cannot load it (the message names the file and Keras's reason).
    """
    digest = hashlib.sha256(model).hexdigest()
    with _signatures_lock:
        if digest in _signatures:
            return _signatures[digest]
    import keras

    handle, path = tempfile.mkstemp(suffix=".keras", prefix="stratkit-describe-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(model)
        try:
            loaded = keras.saving.load_model(path, custom_objects=custom_objects, compile=False, safe_mode=safe_mode)
        except Exception as exc:  # noqa: BLE001 - whatever Keras says, said as a ConfigError naming the file
            raise ConfigError(f"{where} could not be loaded by Keras {keras.__version__}: {type(exc).__name__}: "
                              f"{exc}. Fix: pass custom_objects for its custom layers, safe_mode=False for a model "
                              "with Lambda layers you trust, or save it again with this Keras") from None
        signature = describe(loaded)
        if signature is None:
            raise ConfigError(f"{where} holds a {type(loaded).__name__} model Keras never built, so what it takes "
                              "is unknown. Fix: call it once on a batch (or model.build(...)) before saving it, or "
                              "build it with keras.Input(...)")
    finally:
        os.remove(path)
    with _signatures_lock:
        _signatures[digest] = signature
    return signature


def feature_columns(df: Any, columns: Sequence[str], what: str = PARAMS.features) -> list[Column]:
    """What each feature column holds (`staging.spark_column`); ConfigError for a missing one or a type that feeds
    no model."""
    if isinstance(columns, str) or not columns:
        raise ConfigError(f"{what}={columns!r} must be a non-empty list of column names. Fix: e.g. "
                          f"{what}=['features']")
    schema = df.schema
    names = list(schema.names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise ConfigError(f"{what} names column(s) {missing} that the DataFrame does not have (columns: {names}). "
                          f"Fix: pass {what} from those columns, or add the missing ones to the DataFrame first")
    return [staging.spark_column(schema[name]) for name in columns]


def check_gpu_confs(spark: Any, resource_name: str = "gpu", what: str = PARAMS.gpu) -> None:
    """useGpu needs Spark to schedule GPUs to tasks (a fraction per task is fine for inference)."""
    from stratkit.spark.confs import read_confs, spark_context

    key = f"spark.task.resource.{resource_name}.amount"
    value = read_confs(spark, spark_context(spark)).get(key)
    try:
        amount = float(value) if value is not None else 0.0
    except ValueError:
        amount = 0.0
    if amount <= 0:
        raise ConfigError(f"{what}=True but the Spark conf {key} is {value!r}, so Spark gives tasks no GPU. Fix: set "
                          f"{key} (1, or a fraction such as 0.25 to let 4 tasks share a GPU), "
                          f"spark.executor.resource.{resource_name}.amount and a discovery script, or pass "
                          f"{what}=False")


def score(df: Any, model: bytes, signature: ModelSignature, feature_cols: Sequence[str], *,
          prediction_col: str = "prediction", prediction_cols: Sequence[str] = (),
          batch_size: int = DEFAULT_BATCH_SIZE, use_gpu: bool = False, gpu_resource_name: str = "gpu",
          custom_objects: dict[str, Any] | None = None, safe_mode: bool = True, prediction_kind: str = "raw",
          probability_col: str = "probability", spelling: Spelling = PARAMS) -> Any:
    """`df` with one prediction column per model head (or a classifier's class and probabilities), computed on the
    executors; everything is checked first, on the driver."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{spelling.batch}={batch_size!r} must be a positive integer (rows per model call). Fix: "
                          f"e.g. {spelling.batch}={DEFAULT_BATCH_SIZE}")
    if isinstance(feature_cols, str):
        feature_cols = [feature_cols]
    plan = plan_feeds(signature, feature_columns(df, feature_cols, spelling.features), names=spelling)
    check_classifier(signature, prediction_kind, spelling)
    fields = output_fields(signature, prediction_col, prediction_cols, spelling)
    new_columns = [prediction_col, probability_col] if prediction_kind == "class" else [f.column for f in fields]
    taken = [c for c in new_columns if c in df.columns]
    if taken:
        raise ConfigError(f"prediction column(s) {taken} already exist in the DataFrame. Fix: set "
                          f"{spelling.prediction} (or {spelling.predictions}, {spelling.probability}) to new names, "
                          "or drop those columns first")
    if use_gpu:
        check_gpu_confs(df.sparkSession, gpu_resource_name, spelling.gpu)
    custom = None
    if custom_objects:
        import cloudpickle

        custom = cloudpickle.dumps(custom_objects)
    spec = InferenceSpec(model=model, signature=signature, plan=plan, fields=fields, batch_size=batch_size,
                         use_gpu=use_gpu, gpu_resource_name=gpu_resource_name, custom_objects=custom,
                         safe_mode=safe_mode, digest=hashlib.sha256(model).hexdigest())
    inputs = [staging._column_expression(df, column.name, vector_dtype=_vector_dtype(str(feed.port.dtype)))
              for feed in plan.feeds for column in feed.columns]
    from pyspark.sql import functions as F

    if prediction_kind == "class":
        values = f"__stratkit_values_{spec.digest[:8]}"
        scored = df.withColumn(values, _udf(spec, fields[0].spark_type)(*inputs))
        return _classes(scored, values, fields[0].scalar, prediction_col, probability_col)
    if len(fields) == 1:
        return df.withColumn(fields[0].column, _udf(spec, fields[0].spark_type)(*inputs))

    struct = ", ".join(f"`{f.column}`: {f.spark_type}" for f in fields)
    hidden = f"__stratkit_heads_{spec.digest[:8]}"
    scored = df.withColumn(hidden, _udf(spec, f"struct<{struct}>")(*inputs))
    return scored.select("*", *[F.col(hidden)[f.column].alias(f.column) for f in fields]).drop(hidden)


def _classes(scored: Any, values: str, scalar: bool, prediction_col: str, probability_col: str) -> Any:
    """A classifier's columns, as Spark ML's classifiers give them: the class index (double) and the
    probabilities (a vector): for one value per row (a sigmoid's P(class 1)) [1 - p, p] and p > 0.5, else the
    head's values and the index of the largest."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    head = F.col(values)
    if scalar:
        probability, prediction = F.array(F.lit(1.0) - head, head), (head > 0.5).cast("double")
    else:
        probability = head.cast("array<double>")
        prediction = (F.array_position(head, F.array_max(head)) - 1).cast("double")
    return scored.withColumns({probability_col: array_to_vector(probability),
                               prediction_col: prediction}).drop(values)


def _vector_dtype(dtype: str) -> str:
    return "float32" if dtype in ("float16", "bfloat16", "float32") else "float64"


def _udf(spec: InferenceSpec, return_type: str) -> Any:
    import warnings

    from pyspark.sql import functions as F

    arrow_udf = getattr(F, "arrow_udf", None)
    if PREFER_ARROW and arrow_udf is not None:
        def arrow_run(batches: Any) -> Any:
            yield from predict_batches(spec, batches)

        with warnings.catch_warnings():  # the function type is given, not read from type hints
            warnings.simplefilter("ignore")
            return arrow_udf(arrow_run, return_type, F.ArrowUDFType.SCALAR_ITER)

    def pandas_run(batches: Any) -> Any:
        import pyarrow as pa

        arrays = (tuple(pa.Array.from_pandas(s) for s in b) if isinstance(b, tuple) else pa.Array.from_pandas(b)
                  for b in batches)
        for out in predict_batches(spec, arrays):
            if isinstance(out, pa.StructArray):
                yield pa.Table.from_arrays(out.flatten(), names=[f.name for f in out.type]).to_pandas()
            else:
                yield out.to_pandas()

    from pyspark.sql.functions import PandasUDFType, pandas_udf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pandas_udf(pandas_run, return_type, PandasUDFType.SCALAR_ITER)


def keras_predict(df: Any, model: Any, feature_cols: Sequence[str] | str, *, prediction_col: str = "prediction",
                  prediction_cols: Sequence[str] = (), batch_size: int = DEFAULT_BATCH_SIZE, use_gpu: bool = False,
                  gpu_resource_name: str = "gpu", custom_objects: dict[str, Any] | None = None,
                  safe_mode: bool = True, prediction_kind: str = "raw", probability_col: str = "probability") -> Any:
    """Score a DataFrame with a saved Keras model on the executors; returns `df` with the prediction column(s).

    Every Python worker loads the model once and reuses it for every batch and task; with `useGpu` each uses one
    of its task's Spark GPUs with memory growth (never every GPU of the host). Bad input is a `ConfigError`
    before any Spark job: a missing column, a column that cannot become a tensor, a vector of the wrong size,
    a file that is not a Keras model.

    Args:
        df: the DataFrame (classic or Spark Connect).
        model: the path or URL of a `.keras` file (read on the driver and shipped to the executors with the
            job, so they need no access to it), or a `keras.Model`.
        feature_cols: the columns that feed the model: for a one-input model every column, side by side; for
            N inputs one column per input, in the order of `model.inputs` or named as the inputs (given to the
            model in its list / tuple / dict structure). Numbers, strings, arrays of them or Spark ML vectors, each in its own type
            cast to its input's dtype, reshaped to its input's per-row shape.
        prediction_col: the output column of a one-head model; with N heads `<prediction_col>_<head name>`.
        prediction_cols: one name per head instead.
        batch_size: rows per model call (Arrow batches, `spark.sql.execution.arrow.maxRecordsPerBatch` rows
            each, are joined or cut to it).
        use_gpu: run on one of each task's Spark GPUs (`spark.task.resource.gpu.amount`); False hides GPUs.
        gpu_resource_name: Spark's name of the GPU resource.
        custom_objects: the model's custom layers, losses, ... (as for `keras.saving.load_model`).
        safe_mode: `keras.saving.load_model`'s; False loads Lambda layers (arbitrary code: trusted files only).
        prediction_kind: "raw" (the outputs as they are) or "class" for a one-output classifier: `prediction_col`
            is the class index (a double: the largest value's index, or value > 0.5 for a one-value sigmoid
            head) and `probability_col` the head's values as a Spark ML vector ([1 - p, p] for a sigmoid), as
            Spark ML's classifiers and evaluators have them.
        probability_col: the probabilities' column with prediction_kind="class".

    Returns:
        The DataFrame with the predictions: a double column for a head with one value per row, an array column
        (flattened) for any other head; with prediction_kind="class" the class and the probabilities.

    Raises:
        ConfigError: before any job, naming the column or file and the fix.
    """
    data, where = _model_bytes(model)
    signature = model_signature(data, where, custom_objects, safe_mode)
    return score(df, data, signature, feature_cols, prediction_col=prediction_col, prediction_cols=prediction_cols,
                 batch_size=batch_size, use_gpu=use_gpu, gpu_resource_name=gpu_resource_name,
                 custom_objects=custom_objects, safe_mode=safe_mode, prediction_kind=prediction_kind,
                 probability_col=probability_col, spelling=ARGUMENTS)


def _model_bytes(model: Any) -> tuple[bytes, str]:
    if isinstance(model, (str, os.PathLike)):
        return model_files.read_model(os.fspath(model)), f"model={os.fspath(model)!r}"
    if isinstance(model, (bytes, bytearray)):
        model_files.check_keras_archive(bytes(model), "the model bytes")
        return bytes(model), "the model bytes"
    if hasattr(model, "save") and hasattr(model, "predict"):
        return model_bytes_of(model), f"the {type(model).__name__} model"
    raise ConfigError(f"model must be the path or URL of a .keras file, or a keras.Model: got "
                      f"{type(model).__name__}. Fix: keras_predict(df, 'model.keras', feature_cols=[...])")


def model_bytes_of(model: Any) -> bytes:
    """A Keras model as the bytes of its .keras file."""
    directory = tempfile.mkdtemp(prefix="stratkit-model-")
    path = os.path.join(directory, "model.keras")
    try:
        model.save(path)
        with open(path, "rb") as handle:
            return handle.read()
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(directory)
