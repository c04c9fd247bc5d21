"""`KerasModel`: the Spark ML Model a `KerasEstimator` fits, scoring DataFrames on the executors."""

from __future__ import annotations

from typing import Any

from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from stratkit.errors import ConfigError
from stratkit.spark.ml import inference, model_files
from stratkit.spark.ml.params import TrainingParams
from stratkit.spark.ml.persistence import StageReader, StageWriter
from stratkit.spark.ml.signature import ModelSignature

#: The metadata value that says the stage directory holds `model.keras`.
MODEL_MARKER = "model.keras"


class KerasModel(Model, TrainingParams, MLWritable, MLReadable):
    """A fitted Keras model as a Spark ML Transformer: `transform(df)` adds the prediction column(s).

    Scoring runs on the executors (`stratkit.spark.ml.inference`): each Python worker loads the model once and
    keeps it for every batch and task; batches of `inferenceBatchSize` rows; with `useGpu` one of each task's
    Spark GPUs with memory growth. Columns, widths and types are checked against the model on the driver before
    any job. A one-head model gives `predictionCol` (a double column when the head has one value per row, else a
    flat array); N heads give `<predictionCol>_<head name>` (or `predictionCols`). With `predictionKind="class"`
    a one-output classifier gives Spark ML's classifier columns: `predictionCol` the class index (double) and
    `probabilityCol` the probabilities (a vector), for `MulticlassClassificationEvaluator` and
    `BinaryClassificationEvaluator(rawPredictionCol=probabilityCol)`.

    It saves and loads with `save(path)` / `KerasModel.load(path)` and inside a `PipelineModel`; the saved
    directory holds the Keras file (`model.keras`), which `keras.saving.load_model` opens anywhere.

    A fitted model also carries the estimator's training params (`buildParams`, `epochs`, `batchSize`, ...,
    not `buildFn` or `callbacks`), so a tuned model says which values won.

    Args:
        **params: `featuresCols`, `predictionCol`, `predictionCols`, `inferenceBatchSize`, `useGpu`,
            `customObjects`, `predictionKind`, `probabilityCol`, and the training params (see `KerasEstimator`).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._model: bytes | None = None
        self._signature: ModelSignature | None = None
        #: The per-epoch metrics of the training (`{"loss": [...], "val_loss": [...], ...}`), as Keras's History.
        self.history: dict[str, list[float]] = {}
        #: What the training ran on: workers, replicas, steps per epoch, Keras version.
        self.training_info: dict[str, Any] = {}
        #: The training's `SparkRunner` report (attempts, seconds, the per-phase timeline); not saved.
        self.run_report: Any = None

    @classmethod
    def from_keras(cls, model: Any, **params: Any) -> KerasModel:
        """A `KerasModel` for a Keras model trained elsewhere: a `.keras` file's path or URL, or a `keras.Model`.

        The file is read (and the model described) on the driver now, and shipped to the executors with each job.
        """
        data, where = inference._model_bytes(model)
        stage = cls(**params)
        stage._signature = inference.model_signature(data, where, stage.getOrDefault("customObjects"))
        stage._model = data
        return stage

    @classmethod
    def _fitted(cls, result: dict[str, Any]) -> KerasModel:
        stage = cls()
        model_files.check_keras_archive(result["model"], "the fitted model")
        stage._model = result["model"]
        stage._signature = ModelSignature.from_json(result["signature"])
        stage.history = result.get("history", {})
        stage.training_info = {k: result[k] for k in ("workers", "replicas", "steps_per_epoch", "keras_version")
                               if k in result}
        return stage

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs (names, per-row shapes, dtypes)."""
        return self._require()[1]

    def _require(self) -> tuple[bytes, ModelSignature]:
        if self._model is None or self._signature is None:
            raise ConfigError("this KerasModel holds no model (it was made directly, not fitted or loaded). Fix: get "
                              "it from KerasEstimator.fit, KerasModel.load(path) or KerasModel.from_keras(...)")
        return self._model, self._signature

    def model_bytes(self) -> bytes:
        """The fitted model as the bytes of a `.keras` file."""
        return self._require()[0]

    def keras_model(self) -> Any:
        """The fitted model as a `keras.Model` in this process (imports TensorFlow here)."""
        import os
        import tempfile

        import keras

        handle, path = tempfile.mkstemp(suffix=".keras", prefix="stratkit-model-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(self.model_bytes())
            return keras.saving.load_model(path, custom_objects=self.getOrDefault("customObjects"), safe_mode=False)
        finally:
            os.remove(path)

    def _transform(self, dataset: Any) -> Any:
        model, signature = self._require()
        # safe_mode=False: the bytes are this stage's own fitted model (its saved params are pickled code already)
        return inference.score(dataset, model, signature, self.getOrDefault("featuresCols"),
                               prediction_col=self.getOrDefault("predictionCol"),
                               prediction_cols=self.getOrDefault("predictionCols"),
                               batch_size=self.getOrDefault("inferenceBatchSize"),
                               use_gpu=self.getOrDefault("useGpu"),
                               custom_objects=self.getOrDefault("customObjects"), safe_mode=False,
                               prediction_kind=self.getOrDefault("predictionKind"),
                               probability_col=self.getOrDefault("probabilityCol"))

    # -- persistence -------------------------------------------------------------------------------
    def write(self) -> StageWriter:
        """A writer: `model.write().overwrite().save(path)`."""
        self._require()
        return StageWriter(self)

    @classmethod
    def read(cls) -> StageReader:
        return StageReader(cls)

    def _saved_metadata(self) -> dict[str, Any]:
        _, signature = self._require()
        return {"model": MODEL_MARKER, "signature": signature.to_json(), "history": self.history,
                "training": self.training_info}

    def _saved_model(self) -> bytes | None:
        return self._require()[0]

    def _restore(self, saved: dict[str, Any], model: bytes | None) -> None:
        if model is None or "signature" not in saved:
            raise ConfigError("the saved KerasModel has no model file or signature. Fix: save the fitted model again")
        model_files.check_keras_archive(model, "the saved model.keras")
        self._model = model
        self._signature = ModelSignature.from_json(saved["signature"])
        self.history = saved.get("history", {})
        self.training_info = saved.get("training", {})

