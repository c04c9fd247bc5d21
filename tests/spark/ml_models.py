"""Tiny Keras models for the Spark ML tests, built lazily (importing this module imports no TensorFlow).

Test modules register this module with `cloudpickle.register_pickle_by_value`, so the build functions and
the probe layer travel to the executors by value, as a notebook's would.

The probe layer records, each time a process builds it -- which is when a process loads the model --, the
process id, the device variables of that moment (CUDA_VISIBLE_DEVICES, TF_FORCE_GPU_ALLOW_GROWTH) and whether
TensorFlow's runtime had started already (a private TensorFlow flag: test code only), one JSON line in a file:
how the tests see which Python worker loaded a model, how often, and that TensorFlow started while the
task's GPU was set (the runtime reads CUDA_VISIBLE_DEVICES once, when it starts).
"""

from __future__ import annotations

import functools


def build_regressor(units: int = 8, learning_rate: float = 0.05):
    """3 inputs -> Dense(units, relu) -> Dense(1), SGD on MSE."""
    import keras

    model = keras.Sequential([keras.Input((3,), name="features"), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


@functools.lru_cache(maxsize=1)
def probe_class():
    """The probe layer (a class made on first use, so that Keras is imported only then)."""
    import keras

    class Probe(keras.layers.Layer):
        def __init__(self, log: str = "", **kwargs):
            super().__init__(**kwargs)
            self.log = log

        def build(self, input_shape):
            if self.log:
                import json
                import os

                from tensorflow.python.eager import context

                with open(self.log, "a") as handle:
                    handle.write(json.dumps({"pid": os.getpid(),
                                             "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                             "growth": os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH"),
                                             "started": bool(context.context()._initialized)}) + "\n")

        def call(self, inputs):
            return inputs

        def get_config(self):
            return {**super().get_config(), "log": self.log}

    return Probe


def two_inputs_two_heads(log: str = ""):
    """Inputs "pixels" (2, 2) and "extra" (3,); heads "price" (1 value) and "kind" (3-way softmax)."""
    import keras

    keras.utils.set_random_seed(7)
    pixels = keras.Input((2, 2), name="pixels")
    extra = keras.Input((3,), name="extra")
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(pixels), probe_class()(log)(extra)])
    hidden = keras.layers.Dense(5, activation="tanh")(joined)
    price = keras.layers.Dense(1, name="price")(hidden)
    kind = keras.layers.Dense(3, activation="softmax", name="kind")(hidden)
    return keras.Model([pixels, extra], [price, kind])


# -- models whose columns keep their own types (issue 49) -----------------------------------------

#: The first id of the int64 table: above it a float32 holds only even integers, so parity is lost in one.
ID_BASE = 2**24
#: The words of the string table's StringLookup.
WORDS = tuple(f"w{i}" for i in range(12))


def _seeded(keras, kind: str, seed: int):
    """An initializer with its own seed: the same first weights in every process, whatever else drew numbers."""
    return keras.initializers.GlorotUniform(seed=seed) if kind == "glorot" else \
        keras.initializers.RandomUniform(-0.05, 0.05, seed=seed)


def build_ids(rows: int = 200, learning_rate: float = 0.05):
    """An id (int64 from 2^24) -> IntegerLookup -> Embedding -> P(id is odd): learnable only from exact ids."""
    import keras

    ids = [ID_BASE + i for i in range(rows)]
    inputs = keras.Input((1,), dtype="int64", name="id")
    index = keras.layers.IntegerLookup(vocabulary=ids)(inputs)
    hidden = keras.layers.Flatten()(keras.layers.Embedding(rows + 1, 4,
                                                           embeddings_initializer=_seeded(keras, "u", 1))(index))
    out = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=_seeded(keras, "glorot", 2))(hidden)
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def build_float_ids():
    """The same ids into a float32 input (what a float32 matrix made of them): a cast that loses values."""
    import keras

    model = keras.Sequential([keras.Input((1,), name="id"), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def build_words(learning_rate: float = 0.05):
    """A dict of two inputs: "word" (a string, StringLookup -> Embedding) and "x" (a float) -> one value."""
    import keras

    word = keras.Input((1,), dtype="string", name="word")
    x = keras.Input((1,), name="x")
    index = keras.layers.StringLookup(vocabulary=list(WORDS))(word)
    embedded = keras.layers.Flatten()(keras.layers.Embedding(len(WORDS) + 1, 3,
                                                             embeddings_initializer=_seeded(keras, "u", 3))(index))
    out = keras.layers.Dense(1, kernel_initializer=_seeded(keras, "glorot", 4))(
        keras.layers.Concatenate()([embedded, x]))
    model = keras.Model({"word": word, "x": x}, out)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    return model


def build_two_by_two(learning_rate: float = 0.01):
    """A list of two inputs, "pixels" (64 floats) and "parity" (1 value), and a list of two heads, "digit" (a
    10-way softmax) and "big" (P(digit >= 5))."""
    import keras

    pixels = keras.Input((64,), name="pixels")
    parity = keras.Input((1,), name="parity")
    hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=_seeded(keras, "glorot", 5))(
        keras.layers.Concatenate()([pixels, parity]))
    digit = keras.layers.Dense(10, activation="softmax", name="digit",
                               kernel_initializer=_seeded(keras, "glorot", 6))(hidden)
    big = keras.layers.Dense(1, activation="sigmoid", name="big",
                             kernel_initializer=_seeded(keras, "glorot", 7))(hidden)
    model = keras.Model([pixels, parity], [digit, big])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=["sparse_categorical_crossentropy", "binary_crossentropy"])
    return model


_CLASSES: dict = {}


def subclassed_class():
    """A subclassed model: a tuple (pixels, parity) in, a dict {"big", "digit"} out (made on first use; a plain
    function and dict, not an lru_cache, so both travel by value with a build function that calls it)."""
    if "TwoByTwo" in _CLASSES:
        return _CLASSES["TwoByTwo"]
    import keras

    class TwoByTwo(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=_seeded(keras, "glorot", 8))
            self.digit = keras.layers.Dense(10, activation="softmax", kernel_initializer=_seeded(keras, "glorot", 9))
            self.big = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=_seeded(keras, "glorot", 10))

        def call(self, inputs):
            pixels, parity = inputs
            hidden = self.hidden(keras.ops.concatenate([pixels, keras.ops.cast(parity, pixels.dtype)], axis=-1))
            return {"big": self.big(hidden), "digit": self.digit(hidden)}

    _CLASSES["TwoByTwo"] = TwoByTwo
    return TwoByTwo


def build_subclassed(learning_rate: float = 0.01):
    """`subclassed_class()`'s model, compiled (not built: Keras builds it from the data's shapes)."""
    import keras

    model = subclassed_class()()
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss={"big": "binary_crossentropy", "digit": "sparse_categorical_crossentropy"})
    return model
