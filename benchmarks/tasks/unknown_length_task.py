"""Round 5's input of unknown length (issue 49): ``filter().batch(64)``, no ``steps_per_epoch``, a plain ``model.fit``.

    python benchmarks/tasks/unknown_length_task.py MODE [--epochs 3] [--rows 1000] [--reference]

MODE: ``one`` (``stratkit.make_strategy()`` in a process without a cluster: one device), ``mirrored``
(``make_strategy("mirrored", logical_cpus=2)``) or ``mwms`` (``make_strategy()`` with the TF_CONFIG the caller
set). Keras learns where such an input ends from the step whose ``get_next`` fails: one per epoch. With
``--reference`` the same model (same seed) first trains on one device in this process, and its result is
reported too (a process split into logical CPUs trains one device's numbers on ``/cpu:0``).

Prints one line ``RESULT {json}``: the keys :func:`train` returns, and ``reference`` with the same keys.
``benchmarks/replica_race.py`` runs it 50 times a mode; ``tests/strategy/input_cases.py`` imports
:func:`train` (the case ``unknown_length``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def train(strategy: Any, epochs: int = 3, rows: int = 1000) -> dict:
    """Round 5's job under `strategy`: ``error`` (the exception's type and message, or None), ``iterations``
    (the optimizer's step counter on every local copy), ``steps`` (the train batches that ended), ``w``
    (the weights) and ``loss`` (the history)."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
    # The user's pipeline: rows kept by a predicate, so TensorFlow cannot know how many batches there are.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda x, y: x[0] > -0.5).batch(64)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")

    class Steps(keras.callbacks.Callback):
        """Counts the train batches that ended (the step that meets the end of the input never does)."""

        count = 0

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.count += 1

    steps, error, loss = Steps(), None, []
    try:
        loss = model.fit(dataset, epochs=epochs, verbose=0, callbacks=[steps]).history["loss"]
    except Exception as exc:  # noqa: BLE001 - reported: the caller counts the runs that stopped
        error = f"{type(exc).__name__}: {exc}"
    copies = strategy.experimental_local_results(model.optimizer.iterations.value)
    return {"error": error, "iterations": [int(c.numpy()) for c in copies], "steps": steps.count,
            "w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "loss": [float(v) for v in loss]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("one", "mirrored", "mwms"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()

    import stratkit

    strategy = (stratkit.make_strategy("mirrored", logical_cpus=2) if args.mode == "mirrored"
                else stratkit.make_strategy())
    import tensorflow as tf

    result = {}
    if args.reference:
        result["reference"] = train(tf.distribute.OneDeviceStrategy("/cpu:0"), args.epochs, args.rows)
    result.update(train(strategy, args.epochs, args.rows))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
