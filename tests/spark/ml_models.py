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
