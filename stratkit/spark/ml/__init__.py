"""Spark ML stages for Keras: `KerasEstimator` (train on the executors) and `KerasModel` (score on them).

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from stratkit.spark import KerasEstimator

    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b"], outputCol="raw"),
                                StandardScaler(inputCol="raw", outputCol="features"),
                                KerasEstimator(buildFn=build_model, labelCols=["label"], epochs=5)])
    model = pipeline.fit(df)          # trains on 2 executors with SparkRunner
    model.transform(df)               # + "prediction", computed on the executors
    model.save("pipeline")            # PipelineModel.load("pipeline") anywhere

* `estimator` / `model`: the two stages; `params`: their Params; `persistence`: how they save and load.
* `training`: what each training process runs; `signature`: the stages' names in messages and the prediction
  columns (which columns feed which model input is `stratkit.data.feeds`'s rule, one for training and scoring).
* `inference`: `keras_predict` and the scoring UDF (driver side); `predictor`: the executors' side (the model
  cached per Python worker, one GPU per task).
* `model_files`: the one place model files are read and written (paths and URLs).

Importing this package imports pyspark (the stages subclass pyspark.ml's); TensorFlow is imported only where
a model is loaded (the executors, `KerasModel.keras_model()`, and `keras_predict` describing a file).
"""

from __future__ import annotations

from stratkit.spark.ml.estimator import KerasEstimator
from stratkit.spark.ml.inference import keras_predict
from stratkit.spark.ml.model import KerasModel

__all__ = ["KerasEstimator", "KerasModel", "keras_predict"]
