"""The Params of `KerasEstimator` and `KerasModel` (pyspark.ml style: camelCase names, getX/setX, defaults).

Three groups: what scoring needs (`InferenceParams`), what training says
(`TrainingParams`: the fitted model carries them too, so a tuned model tells
which values won) and the estimator's code (`EstimatorParams`: the build
function and callbacks, which a fitted model does not need to load). Every
value is plain JSON, written by Spark ML's default params writer, except
`PICKLED`'s (functions, callbacks, custom Keras classes), which
`stratkit.spark.ml.persistence` cloudpickles beside it.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters

from stratkit.errors import ConfigError

#: Params whose values are Python objects, saved with cloudpickle (loading them runs code: trusted files only).
PICKLED = ("buildFn", "callbacks", "customObjects")


def _columns(value: Any) -> list[str]:
    """A column name or a list of them -> a list of names."""
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise TypeError(f"{value!r} is not a whole number")
    return int(value)


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{value!r} is not a dict")
    return dict(value)


def _param(name: str, doc: str, converter: Any = TypeConverters.identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


class StageParams(Params):
    """Construction from keyword arguments (an unknown name is a `ConfigError`), and getX/setX for every param."""

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(**self._defaults())
        self.setParams(**params)

    def _defaults(self) -> dict[str, Any]:
        return {}

    def setParams(self, **params: Any) -> StageParams:
        """Set any of the params by name (`stage.setParams(epochs=5, batchSize=64)`)."""
        unknown = sorted(name for name in params if not self.hasParam(name))
        if unknown:
            known = ", ".join(sorted(p.name for p in self.params))
            raise ConfigError(f"{type(self).__name__} has no param {unknown[0]!r}. Fix: use one of {known}")
        return self._set(**params)

    def __getattr__(self, name: str) -> Any:
        """`getEpochs()` / `setEpochs(5)` for each param (Spark ML's getter and setter names)."""
        if name.startswith(("get", "set")) and len(name) > 3:
            param = name[3].lower() + name[4:]
            if isinstance(getattr(type(self), param, None), Param):
                if name.startswith("get"):
                    return lambda: self.getOrDefault(param)
                return lambda value: self._set(**{param: value})
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class InferenceParams(StageParams):
    """What scoring a DataFrame needs (both stages)."""

    featuresCols = _param("featuresCols", "columns that feed the model: for a one-input model all of them side by "
                          "side, for N inputs one per input in the order of model.inputs or named as the inputs "
                          "(numbers, strings, arrays of them, Spark ML vectors; each in its own type)", _columns)
    predictionCol = _param("predictionCol", "the prediction column (one-head models); with N heads the columns are "
                           "<predictionCol>_<head name>", TypeConverters.toString)
    predictionCols = _param("predictionCols", "one prediction column per head, in the model's output order "
                            "(default: from predictionCol)", _columns)
    inferenceBatchSize = _param("inferenceBatchSize", "rows per model call when scoring", _whole)
    useGpu = _param("useGpu", "train each worker, and score each task, on its Spark GPUs "
                    "(spark.task.resource.gpu.amount); False hides GPUs", TypeConverters.toBoolean)
    customObjects = _param("customObjects", "the model's custom Keras classes/functions by name, as for "
                           "keras.saving.load_model (pickled)", _dict)
    predictionKind = _param("predictionKind", "'raw': the model's outputs as they are; 'class' (a one-output "
                            "classifier): predictionCol is the class index and probabilityCol the probabilities, "
                            "as Spark ML's classifiers give them", TypeConverters.toString)
    probabilityCol = _param("probabilityCol", "with predictionKind='class': the probabilities (a vector)",
                            TypeConverters.toString)

    def _defaults(self) -> dict[str, Any]:
        return {"featuresCols": ["features"], "predictionCol": "prediction", "predictionCols": [],
                "inferenceBatchSize": 1024, "useGpu": False, "customObjects": None, "predictionKind": "raw",
                "probabilityCol": "probability"}


class TrainingParams(InferenceParams):
    """What a training is (the estimator's, and the fitted model's record of them)."""

    buildParams = _param("buildParams", "keyword arguments for buildFn (JSON values; tune them with a ParamGrid)",
                         _dict)
    labelCols = _param("labelCols", "label columns: one per model output, in the model's output order", _columns)
    sampleWeightCol = _param("sampleWeightCol", "a column of per-row sample weights (optional)",
                             TypeConverters.toString)
    epochs = _param("epochs", "epochs to train", _whole)
    batchSize = _param("batchSize", "the global batch: rows per step across all workers", _whole)
    numWorkers = _param("numWorkers", "training workers (Spark barrier tasks)", _whole)
    gpusPerWorker = _param("gpusPerWorker", "use only this many of each worker's Spark GPUs (default: all)", _whole)
    stepsPerEpoch = _param("stepsPerEpoch", "steps per epoch (default: one pass over the rows)", _whole)
    validation = _param("validation", "a fraction of the rows held out for validation (0 < f < 1), or the name "
                        "of a boolean column marking validation rows")
    shuffle = _param("shuffle", "reshuffle each worker's rows every epoch", TypeConverters.toBoolean)
    seed = _param("seed", "seed of the weights' initialisation (keras.utils.set_random_seed before buildFn), the "
                  "shuffle and a fractional validation split", _whole)
    verbose = _param("verbose", "Keras verbosity on the chief (2: one line per epoch, streamed to the driver)", _whole)
    backupDir = _param("backupDir", "back up during training and resume there after a failure (a retry, "
                       "maxRetries); a directory every worker can write", TypeConverters.toString)
    backupEvery = _param("backupEvery", "with backupDir: back up every K steps (an int) or after a duration "
                         "('30s', '10min') instead of after every epoch")
    maxRetries = _param("maxRetries", "re-run a failed training (which resumes from backupDir) this many times",
                        _whole)
    timeout = _param("timeout", "seconds for the whole training, retries included", TypeConverters.toFloat)
    tracking = _param("tracking", "MLflow: 'auto' logs into the driver's active run (a child run when a training "
                      "already logged into it), 'nested' a child run of it per fit (tuning), 'mlflow' always "
                      "(a run of its own if none is active), 'off'", TypeConverters.toString)

    def _defaults(self) -> dict[str, Any]:
        return {**super()._defaults(), "buildParams": {}, "labelCols": ["label"], "sampleWeightCol": None,
                "epochs": 1, "batchSize": 32, "numWorkers": 2, "gpusPerWorker": None, "stepsPerEpoch": None,
                "validation": None, "shuffle": True, "seed": None, "verbose": 2, "backupDir": None,
                "backupEvery": None, "maxRetries": 0, "timeout": None, "tracking": "auto"}


class EstimatorParams(TrainingParams):
    """The estimator's code: what builds the model, and the callbacks of its fit."""

    buildFn = _param("buildFn", "a function returning a compiled keras.Model, called with buildParams in each "
                     "training process (pickled)")
    callbacks = _param("callbacks", "Keras callbacks for fit (pickled to every worker)")
    readInPlace = _param("readInPlace", "None (default): a DataFrame that is a plain scan of a Parquet table is read "
                         "in place by the workers, any other is staged; False: always stage; True: read in place "
                         "or refuse (DataFrameInput's in_place)")

    def _defaults(self) -> dict[str, Any]:
        return {**super()._defaults(), "buildFn": None, "callbacks": None, "readInPlace": None}
