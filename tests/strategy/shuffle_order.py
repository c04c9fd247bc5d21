"""Prints the rows this worker trains in each epoch of `model.fit(arrays)` with Keras's default shuffle=True."""

import json

import stratkit

strategy = stratkit.make_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ROWS, EPOCHS = 8, 3
seen: list[int] = []


class Recorder(keras.Model):
    def train_step(self, data):
        x, _ = data
        tf.py_function(lambda rows: seen.extend(int(i) for i in np.argmax(rows.numpy(), axis=1)), [x], [])
        return {"rows": tf.constant(0.0)}


with strategy.scope():
    inputs = keras.Input((ROWS,))
    model = Recorder(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.eye(ROWS, dtype="float32"), np.ones((ROWS, 1), "float32"), batch_size=4, epochs=EPOCHS, verbose=0)
per_epoch = len(seen) // EPOCHS
print("ORDER " + json.dumps([seen[i:i + per_epoch] for i in range(0, len(seen), per_epoch)]), flush=True)
