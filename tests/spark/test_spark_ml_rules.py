"""The Spark ML stages' rules without a JVM or TensorFlow: columns -> inputs, heads -> columns, a task's GPU,
Arrow batches -> model batches, what is a Keras file, the stages' params."""

from __future__ import annotations

import io
import os
import zipfile

import pytest

from stratkit.data.columns import Column
from stratkit.errors import ConfigError
from stratkit.spark.ml.signature import (
    ARGUMENTS,
    PARAMS,
    ModelSignature,
    Port,
    check_classifier,
    output_fields,
    plan_feeds,
)

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")


def _signature(inputs, outputs=(("out", (1,), "float32"),)):
    return ModelSignature(tuple(Port(*p) for p in inputs), tuple(Port(*p) for p in outputs))


def plan_inputs(signature, columns, spelling=PARAMS):
    """The feeds of numeric columns given as (name, values per row or None): a scalar for 1, else an array."""
    columns = [Column(name, "float64", () if width == 1 else (width,)) for name, width in columns]
    return plan_feeds(signature, columns, names=spelling).feeds


# -- columns -> inputs ----------------------------------------------------------------------------

def test_one_input_takes_every_column_side_by_side_and_reshapes_them():
    feeds = plan_inputs(_signature([("image", (8, 8, 1), "float32")]), [("pixels", 60), ("a", 1), ("b", 1),
                                                                         ("c", 1), ("d", 1)])
    assert len(feeds) == 1 and [c.name for c in feeds[0].columns] == ["pixels", "a", "b", "c", "d"]
    assert feeds[0].reshape(10, 64) == (10, 8, 8, 1)


def test_several_inputs_take_one_column_each_in_order():
    feeds = plan_inputs(_signature([("x", (3,), "float32"), ("ids", (5,), "int32")]), [("v", 3), ("tokens", None)])
    assert [(f.port.name, [c.name for c in f.columns]) for f in feeds] == [("x", ["v"]), ("ids", ["tokens"])]
    assert feeds[1].reshape(4, 5) == (4, 5)  # the array column's width, checked on its first batch
    with pytest.raises(ConfigError, match=r"featuresCols 'tokens' give 6 value\(s\) per row, but the model's input "
                                          r"'ids' takes shape \(5,\) \(5 per row\)"):
        feeds[1].reshape(4, 6)


def test_a_width_the_schema_knows_is_checked_against_the_input_naming_the_columns():
    with pytest.raises(ConfigError, match=r"featuresCols 'features' give 2 value\(s\) per row, but the model's "
                                          r"input 'x' takes shape \(3,\) \(3 per row\)\. Fix"):
        plan_inputs(_signature([("x", (3,), "float32")]), [("features", 2)])
    with pytest.raises(ConfigError, match=r"feature_cols 'a \+ b' give 2"):
        plan_inputs(_signature([("x", (3,), "float32")]), [("a", 1), ("b", 1)], ARGUMENTS)


def test_a_column_count_that_fits_no_input_layout_is_refused():
    with pytest.raises(ConfigError, match=r"the model has 2 inputs \(x, y\) but featuresCols names 3 column\(s\)"):
        plan_inputs(_signature([("x", (1,), "float32"), ("y", (1,), "float32")]), [("a", 1), ("b", 1), ("c", 1)])


def test_an_unknown_dimension_takes_what_the_row_has():
    feed = plan_inputs(_signature([("seq", (None, 4), "float32")]), [("s", None)])[0]
    assert feed.reshape(2, 12) == (2, 3, 4)
    with pytest.raises(ConfigError):
        feed.reshape(2, 10)


def test_a_string_input_takes_a_string_column_and_refuses_a_number_column():
    feeds = plan_feeds(_signature([("text", (1,), "string")]), [Column("t", "string")]).feeds
    assert feeds[0].port.dtype == "string"
    with pytest.raises(ConfigError, match=r"column 't' holds float64 numbers but the model's input 'text' takes "
                                          r"strings"):
        plan_inputs(_signature([("text", (1,), "string")]), [("t", 1)])


# -- heads -> columns -----------------------------------------------------------------------------

def test_heads_become_columns_scalars_as_double_the_rest_as_flat_arrays():
    signature = _signature([("x", (3,), "float32")], [("price", (1,), "float32"), ("kind", (3,), "float32"),
                                                      ("count", (), "int32"), ("mask", (2, 2), "float64")])
    fields = output_fields(signature, "prediction")
    assert [(f.column, f.spark_type) for f in fields] == [
        ("prediction_price", "double"), ("prediction_kind", "array<float>"), ("prediction_count", "bigint"),
        ("prediction_mask", "array<double>")]
    assert [f.column for f in output_fields(signature, "p", ["a", "b", "c", "d"])] == ["a", "b", "c", "d"]
    with pytest.raises(ConfigError, match=r"predictionCols=\['a'\] names 1 column\(s\) but the model has 4"):
        output_fields(signature, "p", ["a"])
    assert [f.column for f in output_fields(_signature([("x", (1,), "float32")]), "score")] == ["score"]


def test_class_predictions_need_one_head_of_one_value_or_one_per_class():
    check_classifier(_signature([("x", (3,), "float32")], [("p", (1,), "float32")]), "class")
    check_classifier(_signature([("x", (3,), "float32")], [("p", (10,), "float32")]), "class")
    check_classifier(_signature([("x", (3,), "float32")], [("a", (1,), "float32"), ("b", (2, 2), "float32")]), "raw")
    with pytest.raises(ConfigError, match=r"predictionKind='class' needs a model with one output .* this model "
                                          r"gives a \(1,\), b \(2, 2\)"):
        check_classifier(_signature([("x", (3,), "float32")], [("a", (1,), "float32"), ("b", (2, 2), "float32")]),
                         "class")
    with pytest.raises(ConfigError, match=r"prediction_kind='labels' is not one of \['raw', 'class'\]"):
        check_classifier(_signature([("x", (3,), "float32")]), "labels", ARGUMENTS)


# -- a task's GPU ---------------------------------------------------------------------------------

class _Resource:
    def __init__(self, *addresses):
        self.addresses = list(addresses)


def test_a_scoring_task_takes_one_of_its_gpus_translated_with_memory_growth():
    from stratkit.spark.ml.predictor import task_devices

    env = task_devices(True, {"gpu": _Resource("3", "2")}, "10,11,12,13", environ={})
    assert env == {"CUDA_VISIBLE_DEVICES": "12", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    assert task_devices(True, {"gpu": _Resource("1")}, None, environ={"TF_FORCE_GPU_ALLOW_GROWTH": "false"}) == {
        "CUDA_VISIBLE_DEVICES": "1"}  # the user's own growth setting stands
    assert task_devices(False, {"gpu": _Resource("0")}, None, environ={}) == {"CUDA_VISIBLE_DEVICES": ""}
    with pytest.raises(ConfigError, match=r"useGpu=True but this Spark task got no 'gpu' resource"):
        task_devices(True, {}, None, environ={})
    with pytest.raises(ConfigError, match="not CUDA device ordinals"):
        task_devices(True, {"gpu": _Resource("01")}, None, environ={})


# -- Arrow batches -> model batches ---------------------------------------------------------------

def test_arrow_batches_are_joined_and_cut_into_model_batches_in_order():
    from stratkit.spark.ml.predictor import rebatch

    sizes, start, batches = [3, 7, 2, 10, 1], 0, []
    for size in sizes:
        batches.append((pa.array(range(start, start + size)), pa.array([[float(i)] for i in range(start,
                                                                                                    start + size)])))
        start += size
    out = list(rebatch(iter(batches), 5))
    assert [len(b[0]) for b in out] == [5, 5, 5, 5, 3]
    assert [v for b in out for v in b[0].to_pylist()] == list(range(23))
    assert [v[0] for b in out for v in b[1].to_pylist()] == [float(i) for i in range(23)]


def test_model_outputs_become_arrow_columns_of_the_heads_types():
    import numpy as np

    from stratkit.spark.ml.predictor import InferenceSpec, to_arrow, to_inputs

    signature = _signature([("x", (2, 2), "float32")], [("price", (1,), "float32"), ("kind", (3,), "float32")])
    plan = plan_feeds(signature, [Column("a", "float64", (None,))])
    spec = InferenceSpec(model=b"", signature=signature, plan=plan, fields=output_fields(signature, "p"),
                         batch_size=4)
    inputs = to_inputs(spec, [pa.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], pa.list_(pa.float64()))])
    assert inputs[0].dtype == np.float32 and inputs[0].shape == (2, 2, 2)
    out = to_arrow(spec, [np.array([[0.5], [1.5]], "float32"), np.arange(6, dtype="float32").reshape(2, 3)])
    assert out.type == pa.struct([("p_price", pa.float64()), ("p_kind", pa.list_(pa.float32()))])
    assert out.to_pylist() == [{"p_price": 0.5, "p_kind": [0.0, 1.0, 2.0]}, {"p_price": 1.5, "p_kind": [3.0, 4.0,
                                                                                                          5.0]}]
    with pytest.raises(ConfigError, match=r"column 'a' has 1 null value"):
        to_inputs(spec, [pa.array([[1.0, 2.0, 3.0, 4.0], None], pa.list_(pa.float64()))])


# -- model files ----------------------------------------------------------------------------------

def _zip(**members) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in members.items():
            archive.writestr(name.replace("_json", ".json"), text)
    return buffer.getvalue()


def test_only_a_keras_archive_passes_as_a_model_file(tmp_path):
    from stratkit.spark.ml import model_files

    assert model_files.check_keras_archive(_zip(config_json="{}", metadata_json='{"keras_version": "3.15.1"}'),
                                           "m")["keras_version"] == "3.15.1"
    for data, message in ((b"\x89HDF\r\n\x1a\n...", "is an HDF5 file"), (b"hello", "is not a Keras model file"),
                          (_zip(readme_txt="x"), "without config.json and metadata.json")):
        with pytest.raises(ConfigError, match=message):
            model_files.check_keras_archive(data, "model='x.keras'")
    with pytest.raises(ConfigError, match="is a directory"):
        model_files.read_model(str(tmp_path))


def test_model_files_are_written_whole_and_read_back(tmp_path):
    from stratkit.spark.ml import model_files

    target = model_files.join(str(tmp_path / "stage"), "model.keras")
    model_files.write_file(target, b"first")
    model_files.write_file(f"file://{target}", b"second")
    assert model_files.read_file(target) == b"second" and model_files.exists(target)
    assert os.listdir(tmp_path / "stage") == ["model.keras"]  # no temporary left beside it


# -- params ---------------------------------------------------------------------------------------

def test_the_stages_take_params_by_name_with_getters_and_setters():
    from stratkit.spark import KerasEstimator, KerasModel

    estimator = KerasEstimator(epochs=3, featuresCols="x", buildParams={"units": 4})
    assert (estimator.getEpochs(), estimator.getFeaturesCols(), estimator.getBatchSize()) == (3, ["x"], 32)
    assert estimator.setBatchSize(64).getBatchSize() == 64
    assert estimator.copy({estimator.epochs: 5}).getEpochs() == 5 and estimator.getEpochs() == 3
    with pytest.raises(ConfigError, match=r"KerasEstimator has no param 'epoch'\. Fix: use one of"):
        KerasEstimator(epoch=3)
    with pytest.raises(TypeError):
        KerasEstimator(epochs=1.5)
    assert not KerasModel().hasParam("buildFn") and KerasModel().hasParam("buildParams")


# -- a Spark column's type ------------------------------------------------------------------------

def test_a_spark_column_keeps_its_type_and_a_vector_its_size():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    from stratkit.spark.staging import spark_column

    vector = T.StructField("features", VectorUDT(), metadata={"ml_attr": {"num_attrs": 3}})
    cases = [(T.StructField("id", T.LongType()), ("int64", ())), (T.StructField("w", T.StringType()), ("string", ())),
             (T.StructField("b", T.BinaryType()), ("string", ())), (T.StructField("f", T.BooleanType()), ("bool", ())),
             (T.StructField("m", T.ArrayType(T.ArrayType(T.FloatType()))), ("float32", (None, None))),
             (T.StructField("d", T.DecimalType(10, 0)), ("int64", ())), (vector, ("float64", (3,))),
             (T.StructField("v", VectorUDT()), ("float64", (None,)))]
    for field, (dtype, shape) in cases:
        assert (spark_column(field).dtype, spark_column(field).shape) == (dtype, shape), field
    for kind in (T.TimestampType(), T.MapType(T.StringType(), T.LongType()), T.StructType([])):
        with pytest.raises(ConfigError, match=r"column 'when' has type .*which cannot feed a model\. Fix:"):
            spark_column(T.StructField("when", kind))
