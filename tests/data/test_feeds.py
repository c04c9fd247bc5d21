"""The columns -> model inputs rule (`stratkit.data.feeds`, `stratkit.data.signature`) on real Keras models and
Arrow batches: each structure Keras builds (one input, a list, a tuple, a dict; subclassed models built and not)
gets its columns in its own structure and types, and trains on them as on the same numpy arrays."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stratkit.data.columns import Column, column_of
from stratkit.data.feeds import Names, plan_feeds, plan_for_model
from stratkit.data.signature import ModelSignature, Port, describe, pack
from stratkit.errors import ConfigError

pytestmark = pytest.mark.slow  # imports TensorFlow

ROWS = 16


def _table():
    rng = np.random.default_rng(0)
    pixels = rng.normal(size=(ROWS, 4))
    return pa.table({
        "pixels": pa.array(pixels.tolist(), pa.list_(pa.float64())),
        "id": pa.array(2**40 + np.arange(ROWS), pa.int64()),
        "word": pa.array([f"w{i % 3}" for i in range(ROWS)]),
        "digit": pa.array(np.arange(ROWS) % 3, pa.int64()),
        "price": pa.array(rng.normal(size=ROWS)),
        "weight": pa.array(np.linspace(0.5, 1.5, ROWS)),
    })


def _columns(table, names):
    return [column_of(name, table.schema.field(name).type) for name in names]


def _functional(kind):
    """A model on "pixels" (4 floats) and "id" (int64, hashed): one input, a list, a tuple or a dict of the two;
    two heads, "digit" (softmax) and "price", as a list (a dict for the dict model)."""
    import keras

    keras.utils.set_random_seed(1)
    pixels = keras.Input((4,), name="pixels")
    ids = keras.Input((1,), dtype="int64", name="id")
    hashed = keras.layers.Flatten()(keras.layers.Embedding(8, 2)(keras.layers.Hashing(8)(ids)))
    hidden = keras.layers.Dense(5, activation="tanh")(
        keras.layers.Concatenate()([pixels, hashed]) if kind != "single" else pixels)
    digit = keras.layers.Dense(3, activation="softmax", name="digit")(hidden)
    price = keras.layers.Dense(1, name="price")(hidden)
    inputs = {"single": pixels, "list": [pixels, ids], "tuple": (pixels, ids), "dict": {"pixels": pixels, "id": ids}}
    outputs = {"dict": {"digit": digit, "price": price}}.get(kind, [digit, price])
    model = keras.Model(inputs[kind], outputs)
    losses = {"digit": "sparse_categorical_crossentropy", "price": "mse"}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses if kind == "dict" else list(losses.values()))
    return model


def _subclassed():
    import keras

    class Sub(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(5, activation="tanh")
            self.digit = keras.layers.Dense(3, activation="softmax")
            self.price = keras.layers.Dense(1)

        def call(self, inputs):
            pixels, ids = inputs
            hidden = self.hidden(keras.ops.concatenate([pixels, keras.ops.cast(ids, pixels.dtype)], axis=-1))
            return {"digit": self.digit(hidden), "price": self.price(hidden)}

    keras.utils.set_random_seed(1)
    model = Sub()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"price": "mse", "digit": "sparse_categorical_crossentropy"})
    return model


def _numpy(table, kind):
    pixels = np.array(table["pixels"].to_pylist())
    ids = table["id"].to_numpy().reshape(-1, 1)
    inputs = {"single": pixels, "list": [pixels, ids], "tuple": (pixels, ids), "dict": {"pixels": pixels, "id": ids},
              "subclassed": (pixels, ids.astype("float32"))}[kind]
    digit, price = table["digit"].to_numpy(), table["price"].to_numpy()
    labels = {"digit": digit, "price": price} if kind in ("dict", "subclassed") else [digit, price]
    return inputs, labels


@pytest.mark.parametrize("kind", ["single", "list", "tuple", "dict", "subclassed"])
def test_each_structure_gets_its_columns_in_its_own_structure_and_trains_as_on_numpy(kind):
    import keras
    import tensorflow as tf

    table = _table()
    features = ["pixels"] if kind == "single" else (["id", "pixels"] if kind == "dict" else ["pixels", "id"])
    model = _subclassed() if kind == "subclassed" else _functional(kind)
    labels = ["digit", "price"]
    plan = plan_for_model(model, _columns(table, features), _columns(table, labels), column_of("weight", pa.float64()))
    batch = plan.convert(table)
    structure = {"single": np.ndarray, "list": list, "tuple": tuple, "dict": dict, "subclassed": tuple}[kind]
    assert isinstance(batch.inputs, structure)
    if kind == "dict":
        assert batch.inputs["id"].dtype == np.int64 and batch.inputs["id"].tolist()[1] == [2**40 + 1]
        assert set(batch.labels) == {"digit", "price"} and batch.labels["price"].shape == (ROWS, 1)
    element = batch.element()
    assert len(element) == 3 and not any(isinstance(part, list) for part in keras.tree.flatten(element[:2]))
    # trains (two steps, a weighted loss) as the same arrays do through Keras's own numpy path
    expected = _subclassed() if kind == "subclassed" else _functional(kind)
    inputs, numpy_labels = _numpy(table, kind)
    expected.fit(inputs, numpy_labels, sample_weight=table["weight"].to_numpy(), batch_size=8, epochs=1,
                 shuffle=False, verbose=0)
    model.fit(tf.data.Dataset.from_tensor_slices(element).batch(8), epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    signature = describe(model, fed=plan.signature)
    assert [p.name for p in signature.outputs] == ["digit", "price"]
    assert ModelSignature.from_json(signature.to_json()) == signature
    if kind == "subclassed":  # built from the columns: their names, shapes and the types it was fed
        assert [(p.name, p.shape, p.dtype) for p in signature.inputs] == [("pixels", (4,), "float32"),
                                                                         ("id", (1,), "int64")]


def test_strings_and_int64_ids_reach_their_inputs_in_their_own_types():
    import keras

    word = keras.Input((1,), dtype="string", name="word")
    ids = keras.Input((), dtype="int64", name="id")
    model = keras.Model({"word": word, "id": ids}, keras.layers.StringLookup(vocabulary=["w0", "w1"])(word))
    table = _table()
    plan = plan_for_model(model, _columns(table, ["id", "word"]))
    batch = plan.convert(table)
    assert batch.inputs["word"].dtype == object and batch.inputs["word"][:3, 0].tolist() == [b"w0", b"w1", b"w2"]
    assert batch.inputs["id"].shape == (ROWS,) and batch.inputs["id"][5] == 2**40 + 5
    assert model(batch.inputs).numpy()[:3, 0].tolist() == [1, 2, 0]  # w2 is out of the vocabulary


def test_a_lossy_cast_is_refused_naming_the_column_from_statistics_and_from_the_values():
    signature = ModelSignature((Port("x", (1,), "float32"),), ())
    plan = plan_feeds(signature, [Column("id", "int64")])
    plan.check_ranges({"id": (0, 2**24)})
    with pytest.raises(ConfigError, match=r"column 'id': casting its int64 values to the model's float32 would "
                                          r"change them \(e\.g\. 16777217\)"):
        plan.check_ranges({"id": (0, 2**24 + 1)})
    with pytest.raises(ConfigError, match=r"column 'id'.*16777217"):
        plan.convert(pa.table({"id": pa.array([1, 2**24 + 1], pa.int64())}))
    ints = plan_feeds(ModelSignature((Port("n", (1,), "int32"),), ()), [Column("n", "float64")])
    with pytest.raises(ConfigError, match=r"column 'n': casting its float64 values to the model's int32 .*2\.5"):
        ints.convert(pa.table({"n": pa.array([1.0, 2.5])}))
    floats = plan_feeds(ModelSignature((Port("x", (1,), "float32"),), ()), [Column("x", "float64")])
    floats.check_ranges({"x": (float("-inf"), float("nan"))})  # non-finite floats stay what they are


def test_counts_kinds_and_widths_are_checked_with_the_callers_names():
    names = Names("featuresCols", "labelCols", "sampleWeightCol")
    two = ModelSignature((Port("a", (3,), "float32"), Port("b", (1,), "int64")), (Port("out", (1,), "float32"),))
    with pytest.raises(ConfigError, match=r"the model has 2 inputs \(a, b\) but featuresCols names 3 column\(s\)"):
        plan_feeds(two, [Column("x", "float64")] * 3, names=names)
    with pytest.raises(ConfigError, match=r"featuresCols 'v' give 2 value\(s\) per row, but the model's input 'a' "
                                          r"takes shape \(3,\)"):
        plan_feeds(two, [Column("v", "float64", (2,)), Column("i", "int64")], names=names)
    with pytest.raises(ConfigError, match=r"column 'w' holds strings but the model's input 'b' takes int64"):
        plan_feeds(two, [Column("v", "float64", (3,)), Column("w", "string")], names=names)
    with pytest.raises(ConfigError, match=r"labelCols=\['y', 'z'\] names 2 column\(s\) but the model has 1 output"):
        plan_feeds(two, [Column("v", "float64", (3,)), Column("i", "int64")], [Column("y", "int64"),
                                                                             Column("z", "int64")], names=names)
    with pytest.raises(ConfigError, match="label column 'y' holds strings"):
        plan_feeds(two, [Column("v", "float64", (3,)), Column("i", "int64")], [Column("y", "string")], names=names)
    one = plan_feeds(ModelSignature((Port("image", (2, 2, 1), "float32"),), ()),
                     [Column("p", "float64", (None,)), Column("a", "int64"), Column("b", "float32")])
    batch = one.convert(pa.table({"p": pa.array([[1.0, 2.0]] * 2), "a": pa.array([3, 4]), "b": pa.array([5.0, 6.0],
                                                                                                      pa.float32())}))
    assert batch.inputs.shape == (2, 2, 2, 1) and batch.inputs.dtype == np.float32
    assert batch.inputs.reshape(2, 4).tolist() == [[1, 2, 3, 5], [1, 2, 4, 6]]


def test_a_signature_reads_the_older_saved_form_and_keeps_a_tuple_layout():
    old = {"inputs": [{"name": "a", "shape": [3], "dtype": "float32"}, {"name": "b", "shape": [1], "dtype": "int64"}],
           "outputs": [{"name": "o", "shape": [1], "dtype": "float32"}], "input_structure": "dict",
           "output_structure": "list"}
    signature = ModelSignature.from_json(old)
    assert signature.input_layout == {"a": 0, "b": 1} and signature.output_layout == 0
    tupled = ModelSignature(signature.inputs, signature.outputs, (0, [1]), 0)
    assert ModelSignature.from_json(tupled.to_json()).input_layout == (0, [1])
    assert pack((0, [1]), ["x", "y"]) == ("x", ["y"])
