"""`KerasEstimator`: a Spark ML Estimator whose `fit(df)` trains a Keras model on the executors with `SparkRunner`."""

from __future__ import annotations

from typing import Any

from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from stratkit.errors import ConfigError
from stratkit.spark.data import DataFrameInput
from stratkit.spark.ml import tracking
from stratkit.spark.ml.model import KerasModel
from stratkit.spark.ml.params import EstimatorParams
from stratkit.spark.ml.persistence import StageReader, StageWriter
from stratkit.spark.ml.signature import PREDICTION_KINDS
from stratkit.spark.ml.training import TrainJob, train_on_executor
from stratkit.spark.runner import SparkRunner, SparkTrainingError

#: The line a ConfigError raised in a training process ends its output with.
_CONFIG_ERROR = "stratkit.errors.ConfigError: "


class KerasEstimator(Estimator, EstimatorParams, MLWritable, MLReadable):
    """Train a Keras model on a DataFrame across Spark executors; `fit(df)` returns a `KerasModel`.

        estimator = KerasEstimator(buildFn=build_model, featuresCols=["scaled"], labelCols=["label"],
                                   epochs=5, batchSize=64, numWorkers=2)
        model = Pipeline(stages=[assembler, scaler, estimator]).fit(df)   # a PipelineModel
        scored = model.transform(df)                                       # + "prediction"

    `fit` runs `SparkRunner(numWorkers).run(...)` on a `DataFrameInput` of the feature, label and sample weight
    columns, so it does what they do: the rows staged once as Parquet (a plain Parquet scan read in place
    instead) and each read by exactly one worker per epoch, one barrier task per worker with the training in a fresh process (MultiWorkerMirrored), the global
    batch kept at any world size, every worker's output streamed to the driver as `[worker:1] ...`, retries
    (`maxRetries`) resuming from `backupDir`, preemption notices, the replica check before the model is saved.
    The chief sends the trained `.keras` file back to the driver; the `KerasModel` holds it.

    Columns feed the model by the rule of `stratkit.data.feeds`: for a one-input model every feature column side
    by side (scalars, arrays, Spark ML vectors), reshaped to the input's shape; for N inputs one column per input,
    in the order of `model.inputs`, in the model's list / tuple / dict structure. One label column per model
    output. Each column keeps its own type up to the model's input (int64 ids exact, strings for string inputs);
    a cast that would change a value is a `ConfigError` naming the column before training.

    Params (keyword arguments, or `setX`/`getX`; all are Spark ML Params, so `ParamGridBuilder` tunes them):
        buildFn: a function returning a compiled `keras.Model` (called in each training process, with
            `buildParams` as keyword arguments; import Keras inside it).
        buildParams: keyword arguments for buildFn (JSON values), e.g. `{"units": 64, "learning_rate": 1e-3}`.
        featuresCols: the feature columns (default `["features"]`).
        labelCols: one label column per model output (default `["label"]`).
        sampleWeightCol: a column of per-row sample weights (default none).
        predictionCol / predictionCols: the model's output column(s) (see `KerasModel`).
        epochs: epochs (default 1).
        batchSize: the global batch, rows per step across all workers (default 32).
        stepsPerEpoch: steps per epoch (default: one pass over the rows).
        numWorkers: training workers = Spark barrier tasks (default 2).
        useGpu / gpusPerWorker: train on each task's Spark GPUs (as `SparkRunner`); the model scores on them too.
        validation: a fraction of rows held out (`0.2`), or a boolean column marking validation rows.
        shuffle: reshuffle each worker's rows every epoch (default True).
        seed: `keras.utils.set_random_seed(seed)` before buildFn, the shuffle's and a fractional split's seed.
        verbose: Keras verbosity on the chief (default 2: one line per epoch).
        callbacks: Keras callbacks for `fit` (pickled to every worker; TensorBoard/ModelCheckpoint write on the
            chief only).
        backupDir / backupEvery: back up while training and resume there on a retry (`Trainer.fit`'s).
        maxRetries / timeout: `SparkRunner`'s.
        tracking: MLflow (`stratkit.spark.ml.tracking`): "auto" (default) logs into the driver's active run (a
            child run when a training already logged into it); "nested" a child run per fit (tuning trials);
            "mlflow" always logs; "off".
        inferenceBatchSize: rows per model call when the fitted model scores (default 1024).
        predictionKind / probabilityCol: "class" for a classifier's class index and probabilities (see
            `KerasModel`); default "raw".
        customObjects: custom Keras classes/functions the saved model needs to load.
        readInPlace: None (default): a DataFrame that is a plain scan of a Parquet table (`spark.read.parquet(p)`)
            without a validation split is read in place by the workers, with no staging copy
            (`stratkit.spark.in_place`); False: always stage; True: read in place or raise a `ConfigError`.
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)

    def write(self) -> StageWriter:
        """A writer: `estimator.write().overwrite().save(path)` (the build function is cloudpickled)."""
        return StageWriter(self)

    @classmethod
    def read(cls) -> StageReader:
        return StageReader(cls)

    def _saved_metadata(self) -> dict[str, Any]:
        return {}

    def _saved_model(self) -> bytes | None:
        return None

    def _restore(self, saved: dict[str, Any], model: bytes | None) -> None:
        return None

    def _tracking_context(self) -> Any:
        """What `fit` hands every training process for experiment tracking (`TrainJob.tracking`; None: none).

        The one place a tracker joins the training: the object returned here is pickled to each worker, where
        `training.tracking_callbacks` asks it for Keras callbacks (`tracking.callbacks(trainer)`); which MLflow
        run they log into is decided on the driver around the training (`stratkit.spark.ml.tracking`).
        """
        return tracking.context(self.getOrDefault("tracking"), params=self.getOrDefault("buildParams"))

    # -- fit ---------------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> KerasModel:
        job = self._job(dataset)
        train, validation = self._split(dataset, job)
        runner = SparkRunner(num_workers=self.getOrDefault("numWorkers"), use_gpu=self.getOrDefault("useGpu"),
                             gpus_per_worker=self.getOrDefault("gpusPerWorker"), spark=dataset.sparkSession,
                             max_retries=self.getOrDefault("maxRetries"), timeout=self.getOrDefault("timeout"))
        columns = {"feature_cols": list(job.feature_cols), "label_col": list(job.label_cols),
                   "weight_col": job.weight_col}   # staged each in its own type
        inputs = DataFrameInput(train, in_place=self.getOrDefault("readInPlace"), **columns)
        inputs.described = ("the DataFrame passed to fit()", "readInPlace=False", "readInPlace=True")
        held_out = None if validation is None else DataFrameInput(validation, **columns)
        try:
            with tracking.driver_run(self.getOrDefault("tracking")):   # the run SparkRunner hands the chief
                result = runner.run(train_on_executor, job, inputs, held_out)
        except SparkTrainingError as error:
            config = next((line for line in reversed(error.lines) if line.startswith(_CONFIG_ERROR)), None)
            if config is not None:  # the same ConfigError a local run raises, not a failed task
                raise ConfigError(config[len(_CONFIG_ERROR):]) from error
            raise
        if not isinstance(result, dict) or "model" not in result:
            raise SparkTrainingError(f"the chief returned no model ({type(result).__name__}); see its output above")
        model = KerasModel._fitted(result)
        model.run_report = runner.last_run
        self._copyValues(model)
        return model

    def _job(self, dataset: Any) -> TrainJob:
        """Every param checked, and the training's description; a ConfigError before any Spark job."""
        get = self.getOrDefault
        build_fn = get("buildFn")
        if not callable(build_fn):
            raise ConfigError(f"buildFn must be a function that returns a compiled keras.Model: got {build_fn!r}. "
                              "Fix: KerasEstimator(buildFn=build_model, ...), with `def build_model(): ...; "
                              "model.compile(...); return model`")
        features, labels = list(get("featuresCols")), list(get("labelCols"))
        weight = get("sampleWeightCol")
        columns = features + labels + ([weight] if weight else [])
        missing = [c for c in columns if c not in dataset.columns]
        if missing:
            raise ConfigError(f"column(s) {missing} of featuresCols/labelCols/sampleWeightCol are not in the "
                              f"DataFrame (columns: {dataset.columns}). Fix: name existing columns, or add those "
                              "(e.g. with VectorAssembler) before this stage")
        if not labels:
            raise ConfigError("labelCols is empty. Fix: name the label column(s), one per model output")
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ConfigError(f"column(s) {repeated} appear more than once in featuresCols/labelCols/"
                              "sampleWeightCol. Fix: a label is not a feature; name each column once")
        for name in ("epochs", "batchSize", "numWorkers"):
            if get(name) < 1:
                raise ConfigError(f"{name}={get(name)} must be at least 1. Fix: e.g. {name}=2")
        if get("predictionKind") not in PREDICTION_KINDS:
            raise ConfigError(f"predictionKind={get('predictionKind')!r} is not one of {list(PREDICTION_KINDS)}. "
                              "Fix: 'raw' (the model's outputs) or 'class' (a classifier's class and probabilities)")
        workers, batch = get("numWorkers"), get("batchSize")
        if not get("useGpu") and batch % workers:
            raise ConfigError(f"batchSize={batch} (the global batch) does not split evenly over numWorkers={workers} "
                              f"CPU workers. Fix: batchSize={batch - batch % workers or workers} or another multiple "
                              f"of {workers}")
        return TrainJob(build_fn=build_fn, build_params=dict(get("buildParams") or {}), feature_cols=tuple(features),
                        label_cols=tuple(labels), weight_col=weight, epochs=get("epochs"), batch_size=batch,
                        steps_per_epoch=get("stepsPerEpoch"), shuffle=get("shuffle"), seed=get("seed"),
                        verbose=get("verbose"), callbacks=tuple(get("callbacks") or ()),
                        backup_dir=get("backupDir"), backup_every=get("backupEvery"),
                        tracking=self._tracking_context())

    def _split(self, dataset: Any, job: TrainJob) -> tuple[Any, Any]:
        """(training rows, validation rows or None) by the `validation` param."""
        from pyspark.sql import functions as F

        validation = self.getOrDefault("validation")
        rows = dataset.select(*job.columns)
        if validation is None:
            return rows, None
        if isinstance(validation, str):
            if validation not in dataset.columns:
                raise ConfigError(f"validation={validation!r} is not a column of the DataFrame (columns: "
                                  f"{dataset.columns}). Fix: name a boolean column that marks validation rows, or "
                                  "give a fraction such as validation=0.2")
            if validation in job.columns:
                raise ConfigError(f"validation={validation!r} is also a feature or label column. Fix: mark "
                                  "validation rows with a column of their own")
            marked = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
            chosen = dataset.select(*job.columns, marked.alias("__stratkit_validation"))
            pick = F.col("__stratkit_validation")
            return (chosen.filter(~pick).drop("__stratkit_validation"),
                    chosen.filter(pick).drop("__stratkit_validation"))
        if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0 < validation < 1:
            raise ConfigError(f"validation={validation!r} must be a fraction between 0 and 1 or a column name. "
                              "Fix: e.g. validation=0.2")
        seed = job.seed if job.seed is not None else 20170601
        train, held_out = rows.randomSplit([1.0 - validation, float(validation)], seed=seed)
        return train, held_out
