"""Data for the ported tutorials: scikit-learn's 8x8 digits (shipped with the package, no download).

The TensorFlow tutorials download MNIST; `stratkit launch` runs tasks in a private
network namespace without internet, so the ports use data that is already on disk.
"""

from __future__ import annotations

import json


def load_digits_split(test_size: int = 397):
    """(x_train, y_train, x_test, y_test) as float32 [0, 1] / int32, one fixed split on every worker."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype("float32")
    y = data.target[order].astype("int32")
    return x[:-test_size], y[:-test_size], x[-test_size:], y[-test_size:]


def build_model():
    """The tutorials' small classifier, for 64 inputs (uncompiled: each tutorial compiles its own way)."""
    import keras

    keras.utils.set_random_seed(0)   # the same initial weights in every run and on every worker
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def report(**numbers) -> None:
    """The script's last line: its key numbers as JSON (tests read it)."""
    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in numbers.items()}), flush=True)
