"""Round 5's input of unknown length (issue 49): ``filter().batch(64)``, no ``steps_per_epoch``, a plain ``model.fit``.

    python benchmarks/tasks/unknown_length_task.py MODE [--epochs 3] [--rows 1000] [--reference]

MODE: ``one`` (``stratkit.make_strategy()`` in a process without a cluster: one device), ``mirrored``
(``make_strategy("mirrored", logical_cpus=2)``) or ``mwms`` (``make_strategy()`` with the TF_CONFIG the caller
set). Keras learns where such an input ends from the step whose ``get_next`` fails: one per epoch. With
``--reference`` the same model (same seed) first trains on one device in this process, and its result is
reported too (a process split into logical CPUs trains one device's numbers on ``/cpu:0``).

Prints one line ``RESULT {json}``: ``error`` (the exception's type and message, or null), ``iterations`` (the
optimizer's step counter on every local copy), ``steps`` (the train batches that ended), ``w`` (the weights),
``loss`` (the history), and ``reference`` with the same keys.
"""

from __future__ import annotations

import argparse
import json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("mode", choices=("one", "mirrored", "mwms"))
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--rows", type=int, default=1000)
parser.add_argument("--reference", action="store_true")
args = parser.parse_args()

import stratkit  # noqa: E402

strategy = stratkit.make_strategy("mirrored", logical_cpus=2) if args.mode == "mirrored" else stratkit.make_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
X = rng.normal(size=(args.rows, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


class Steps(keras.callbacks.Callback):
    """Counts the train batches that ended (the step that meets the end of the input never does)."""

    def on_train_begin(self, logs=None):
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def train(on):
    # The user's pipeline: rows kept by a predicate, so TensorFlow cannot know how many batches there are.
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: x[0] > -0.5).batch(64)
    with on.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    steps, error, loss = Steps(), None, []
    try:
        loss = model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[steps]).history["loss"]
    except Exception as exc:  # noqa: BLE001 - reported: the caller counts the runs that stopped
        error = f"{type(exc).__name__}: {exc}"
    copies = on.experimental_local_results(model.optimizer.iterations.value)
    return {"error": error, "iterations": [int(c.numpy()) for c in copies], "steps": steps.count,
            "w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "loss": [float(v) for v in loss]}


result = {"reference": train(tf.distribute.OneDeviceStrategy("/cpu:0"))} if args.reference else {}
result.update(train(strategy))
print("RESULT " + json.dumps(result), flush=True)
