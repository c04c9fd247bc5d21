"""Batch inference inside a Spark Python worker: the model loaded once per worker, batches in, predictions out.

What runs on the executors for `KerasModel.transform` and `keras_predict`
(the driver side, `stratkit.spark.ml.inference`, builds the UDF around
`predict_batches`):

  1. The first batch of a task in a Python worker that has not loaded this
     model yet decides the worker's devices, before TensorFlow starts in it:
     with `use_gpu` one of the task's Spark GPU addresses (translated through
     the executor's CUDA_VISIBLE_DEVICES, `stratkit.cluster.gpus`), with
     memory growth, so several workers can share a GPU and none maps every
     GPU of the host; without, no GPU at all. TensorFlow's intra-op threads
     are the task's `spark.task.cpus`. The worker's environment is restored
     once TensorFlow has started: a later training task in the same worker
     (`SparkRunner`) remaps its GPUs from the executor's own.
  2. The model (the `.keras` bytes shipped in the UDF) is loaded and traced
     once, and kept for every later batch and task of that worker (Spark
     reuses Python workers), keyed by the bytes' digest (the last 3 models).
  3. Arrow batches are cut or joined into batches of exactly `batch_size`
     rows (the last of a partition smaller), turned into numpy without a
     per-row step, predicted, and returned as Arrow arrays (one per head, or a
     struct of them).

Spark reuses a Python worker for tasks that may have another GPU address;
the worker keeps the GPU its first task had (one TensorFlow runtime cannot
move), so with several GPUs per executor two workers can share one GPU (with
memory growth) while another idles. One GPU per executor (or
`spark.task.resource.gpu.amount` = 1 / cores) avoids it.
"""

from __future__ import annotations

import collections
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from stratkit.cluster import gpus
from stratkit.data.feeds import FeedPlan
from stratkit.data.signature import ModelSignature, pack
from stratkit.errors import ConfigError
from stratkit.spark import layout
from stratkit.spark.ml.signature import OutputField
from stratkit.tf_logging import quiet_defaults, quiet_tensorflow_import

#: Models kept per Python worker (a CrossValidator scores one per fit; older ones are dropped).
CACHED_MODELS = 3


@dataclass(frozen=True)
class InferenceSpec:
    """Everything a task needs to score (pickled into the UDF on the driver)."""

    model: bytes  # the .keras file
    signature: ModelSignature
    plan: FeedPlan  # which columns feed which input, in which dtype (`stratkit.data.feeds`)
    fields: tuple[OutputField, ...]
    batch_size: int
    use_gpu: bool = False
    gpu_resource_name: str = "gpu"
    #: The model's custom Keras objects, cloudpickled: unpickling Keras classes imports TensorFlow, which must
    #: wait until the task's devices are set (unpickling the UDF itself must not start it).
    custom_objects: bytes | None = None
    safe_mode: bool = True
    digest: str = field(default="", compare=False)

    def key(self) -> tuple:
        return (self.digest or hashlib.sha256(self.model).hexdigest(), self.use_gpu, self.safe_mode)


# -- devices -------------------------------------------------------------------------------------

def task_devices(use_gpu: bool, resources: dict[str, Any], preset: str | None,
                 resource_name: str = "gpu", environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables TensorFlow must start with in this task's worker: one of its Spark GPUs, or none.

    Args:
        use_gpu: take one of the task's GPUs (else hide every GPU).
        resources: the task's Spark resources (`TaskContext.resources()`: name -> object with `.addresses`).
        preset: the executor's CUDA_VISIBLE_DEVICES, through which Spark's addresses are translated.
        environ: the worker's environment (a TF_FORCE_GPU_ALLOW_GROWTH the user set is kept).

    Raises:
        ConfigError: use_gpu without a GPU resource on the task, or addresses that are not CUDA ordinals.
    """
    if not use_gpu:
        return gpus.Assignment("").env()
    owned = resources.get(resource_name)
    addresses = list(getattr(owned, "addresses", None) or [])
    if not addresses:
        raise ConfigError(f"useGpu=True but this Spark task got no {resource_name!r} resource. Fix: set "
                          f"spark.task.resource.{resource_name}.amount (e.g. 1, or 0.25 for 4 tasks per GPU), "
                          f"spark.executor.resource.{resource_name}.amount and a discovery script, or pass "
                          "useGpu=False")
    first = layout.check_gpu_addresses(addresses, resource_name)[:1]
    env = gpus.Assignment(",".join(layout.remap_visible(first, preset)), shared=True).env()
    if gpus.GROWTH_VAR in (environ if environ is not None else os.environ):
        env.pop(gpus.GROWTH_VAR)  # the user's own choice stands
    return env


@contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _task_context() -> Any:
    try:
        from pyspark import TaskContext

        return TaskContext.get()
    except Exception:  # noqa: BLE001 - outside Spark (a local test of this module): no task
        return None


def _task_devices(spec: InferenceSpec) -> dict[str, str]:
    context = _task_context()
    resources = dict(context.resources()) if context is not None else {}
    return task_devices(spec.use_gpu, resources, os.environ.get("CUDA_VISIBLE_DEVICES"), spec.gpu_resource_name)


#: The devices this worker's TensorFlow started with, when stratkit started it (None: not started here).
_started_with: dict[str, str] | None = None
_told: set[str] = set()


def _start_tensorflow(changes: dict[str, str]) -> dict[str, str]:
    """Start TensorFlow in this worker (inside `_environment(changes)`) with the task's threads and memory growth;
    the devices it runs with."""
    global _started_with
    if "tensorflow" in sys.modules:  # started already: by an earlier model here, or by other code in the worker
        started = _started_with
        wanted = changes.get("CUDA_VISIBLE_DEVICES")
        if started is None or started.get("CUDA_VISIBLE_DEVICES") != wanted:
            note = (f"TensorFlow was started in this Python worker before (by other code), so this task's devices "
                    f"(CUDA_VISIBLE_DEVICES={wanted!r}) cannot be set for it" if started is None else
                    f"this Python worker's TensorFlow started with CUDA_VISIBLE_DEVICES="
                    f"{started.get('CUDA_VISIBLE_DEVICES')!r} and cannot move to this task's {wanted!r}")
            if note not in _told:
                _told.add(note)
                print(f"[stratkit] {note}: the model runs on the devices TensorFlow has", file=sys.stderr)
        return dict(started or {})
    context = _task_context()
    cpus = int(context.cpus()) if context is not None and hasattr(context, "cpus") else None
    with quiet_tensorflow_import():  # TensorFlow's start-up lines, as every training process of stratkit drops them
        import tensorflow as tf

    if cpus and "TF_NUM_INTRAOP_THREADS" not in os.environ:
        tf.config.threading.set_intra_op_parallelism_threads(cpus)
    if changes.get(gpus.GROWTH_VAR) == "true":
        for device in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(device, True)
    tf.constant(0)  # the runtime starts here, reading CUDA_VISIBLE_DEVICES
    _started_with = dict(changes)
    return dict(changes)


# -- the model -----------------------------------------------------------------------------------

class Predictor:
    """One loaded model and its traced forward pass (one per model per Python worker)."""

    def __init__(self, spec: InferenceSpec) -> None:
        wanted = _task_devices(spec)
        # Set while TensorFlow starts and the model loads; the worker's own values come back after.
        with _environment({**quiet_defaults(os.environ), **wanted}):
            #: The variables this worker's TensorFlow started with (CUDA_VISIBLE_DEVICES, memory growth).
            self.environment = _start_tensorflow(wanted)
            self.model = _load(spec)
        import keras
        import tensorflow as tf

        model, fed = self.model, spec.plan.signature  # as the model is fed: every input's dtype known
        specs = [tf.TensorSpec((None, *port.shape), tf.string if port.dtype == "string" else port.dtype)
                 for port in fed.inputs]
        layout = fed.input_layout

        @tf.autograph.experimental.do_not_convert  # no Python control flow to convert
        def forward(*inputs):  # the model's own list / tuple / dict of its inputs
            return keras.tree.flatten(model(pack(layout, inputs), training=False))

        self._forward = tf.function(forward, input_signature=specs)

    def predict(self, inputs: Sequence[Any]) -> list[Any]:
        """Numpy inputs (one per model input) -> numpy outputs (one per head)."""
        return [out.numpy() for out in self._forward(*inputs)]


def _load(spec: InferenceSpec) -> Any:
    import keras

    handle, path = tempfile.mkstemp(suffix=".keras", prefix="stratkit-model-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(spec.model)
        custom = None
        if spec.custom_objects is not None:
            import cloudpickle

            custom = cloudpickle.loads(spec.custom_objects)
        return keras.saving.load_model(path, custom_objects=custom, compile=False, safe_mode=spec.safe_mode)
    finally:
        os.remove(path)


_models: collections.OrderedDict[tuple, Predictor] = collections.OrderedDict()
_lock = threading.Lock()


def predictor_for(spec: InferenceSpec) -> Predictor:
    """This worker's predictor for `spec`'s model: loaded by the first task that needs it, then reused."""
    key = spec.key()
    with _lock:
        found = _models.get(key)
        if found is not None:
            _models.move_to_end(key)
            return found
        predictor = Predictor(spec)
        _models[key] = predictor
        while len(_models) > CACHED_MODELS:
            _models.popitem(last=False)
        return predictor


# -- Arrow in, Arrow out -------------------------------------------------------------------------

def to_inputs(spec: InferenceSpec, columns: Sequence[Any]) -> list[Any]:
    """Arrow feature columns (in the feeds' order) -> one numpy array per model input, shaped and typed by
    `stratkit.data.feeds` (each column in its own type, cast to its input's dtype; a cast that would change a value,
    a null or a width that fits no input is a `ConfigError` naming the column)."""
    names = [column.name for feed in spec.plan.feeds for column in feed.columns]
    return spec.plan.input_values(dict(zip(names, columns)))


def to_arrow(spec: InferenceSpec, outputs: Sequence[Any]) -> Any:
    """Numpy outputs (one per head) -> one Arrow array: the head's column, or a struct of every head's."""
    import pyarrow as pa

    arrays = [_head_array(field, values) for field, values in zip(spec.fields, outputs)]
    if len(arrays) == 1:
        return arrays[0]
    return pa.StructArray.from_arrays(arrays, names=[f.column for f in spec.fields])


_ARROW_TYPES = {"double": "float64", "float": "float32", "bigint": "int64", "int": "int32", "boolean": "bool_",
                "string": "string"}


def _head_array(field: OutputField, values: Any) -> Any:
    import numpy as np
    import pyarrow as pa

    spark_type = field.spark_type
    element = spark_type[len("array<"):-1] if spark_type.startswith("array<") else spark_type
    arrow_type = getattr(pa, _ARROW_TYPES[element])()
    rows = values.shape[0]
    flat = values.reshape(rows, -1)
    if element == "string":  # a string head (e.g. StringLookup(invert=True)): bytes -> text
        data = pa.array([v.decode() if isinstance(v, bytes) else str(v) for v in flat.reshape(-1)], type=arrow_type)
    else:
        data = pa.array(flat.reshape(-1).astype(arrow_type.to_pandas_dtype(), copy=False), type=arrow_type)
    if field.scalar:
        return data
    width = flat.shape[1]
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width, type=pa.int32())
    return pa.ListArray.from_arrays(offsets, data)


def rebatch(batches: Iterator[Sequence[Any]], size: int) -> Iterator[list[Any]]:
    """Arrow column batches -> batches of exactly `size` rows (the last one smaller), in order."""
    import pyarrow as pa

    pending: list[Sequence[Any]] = []
    held = 0
    for columns in batches:
        pending.append(columns)
        held += len(columns[0])
        if held < size:
            continue
        joined = [pa.concat_arrays([b[i] for b in pending]) for i in range(len(columns))]
        start = 0
        while held - start >= size:
            yield [c.slice(start, size) for c in joined]
            start += size
        pending = [[c.slice(start) for c in joined]] if start < held else []
        held -= start
    if held:
        yield [pa.concat_arrays([b[i] for b in pending]) for i in range(len(pending[0]))]


def predict_batches(spec: InferenceSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """The UDF body: Arrow input batches (an array, or a tuple of arrays) -> Arrow prediction arrays."""
    predictor = None
    normalized = (b if isinstance(b, (tuple, list)) else (b,) for b in batches)
    for columns in rebatch(normalized, spec.batch_size):
        if predictor is None:  # the first batch: a task with no rows never loads the model
            predictor = predictor_for(spec)
        yield to_arrow(spec, predictor.predict(to_inputs(spec, columns)))
