"""Saving and loading the two stages (`MLWritable`/`MLReadable`), alone or inside a Pipeline or a tuning model.

A saved stage is a directory:
  * `metadata/`: Spark ML's default params writer's JSON (class, uid, params,
    defaults, Spark version) -- so `Pipeline`/`PipelineModel` save and load
    the stage as they do any Python stage; a `KerasModel` adds its signature,
    training history and Keras version to it;
  * `params.pkl`: the params whose values are Python objects (`PICKLED`:
    the build function, callbacks, custom Keras classes), cloudpickled;
    loading it runs code, as loading any pickled function does: load only
    stages you trust;
  * `model.keras` (a `KerasModel`): the fitted Keras model.
The two files go through `model_files` (the one place files are read and
written). The metadata comes first, so saving over an existing stage without
`.overwrite()` fails before any file of it changes.

Spark Connect: the metadata is written by the Connect server and the two
files by the client, so the path must be one both see (the same machine, or
a URL of shared storage); `.overwrite()` removes the old directory through
the server, as Spark's own stages do.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from stratkit.errors import ConfigError
from stratkit.spark.ml import model_files
from stratkit.spark.ml.params import PICKLED

PARAMS_FILE = "params.pkl"
MODEL_FILE = "model.keras"


def _is_remote() -> bool:
    try:
        from pyspark.sql.utils import is_remote

        return bool(is_remote())
    except ImportError:  # pragma: no cover - pyspark < 3.4
        return False


class StageWriter(MLWriter):
    """Writes a `KerasEstimator` or `KerasModel` (see the module docstring)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        if _is_remote():  # no JVM on the client: the server removes the directory
            from pyspark.ml.connect.readwrite import RemoteMLWriter

            RemoteMLWriter.handleOverwrite(path, True)
        else:
            super()._handleOverwrite(path)

    def saveImpl(self, path: str) -> None:
        instance = self.instance
        values = {param.name: value for param, value in instance._paramMap.items()}
        plain = {name: value for name, value in values.items() if name not in PICKLED}
        pickled = {name: value for name, value in values.items() if name in PICKLED and value is not None}
        extra = {"stratkit": {**instance._saved_metadata(), "pickled": sorted(pickled)}}
        DefaultParamsWriter.saveMetadata(instance, path, self.sparkSession, extraMetadata=extra, paramMap=plain)
        if pickled:
            import cloudpickle

            model_files.write_file(model_files.join(path, PARAMS_FILE), cloudpickle.dumps(pickled))
        model = instance._saved_model()
        if model is not None:
            model_files.write_file(model_files.join(path, MODEL_FILE), model)


class StageReader(MLReader):
    """Reads what `StageWriter` wrote into a new instance of `cls`."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata, skipParams=list(PICKLED))
        ours = metadata.get("stratkit", {})
        if ours.get("pickled"):
            import cloudpickle

            instance._set(**cloudpickle.loads(model_files.read_file(model_files.join(path, PARAMS_FILE))))
        model = None
        if ours.get("model"):
            try:
                model = model_files.read_file(model_files.join(path, MODEL_FILE))
            except FileNotFoundError:
                raise ConfigError(f"{path!r} has the metadata of a fitted {self.cls.__name__} but no {MODEL_FILE}: "
                                  "its save did not finish. Fix: save the model again") from None
        instance._restore(ours, model)
        return instance
