"""Port of "Save and load a model using a distribution strategy"
(tensorflow/docs, tutorials/distribute/save_and_load.ipynb).

The tutorial trains under MirroredStrategy, then saves with the Keras API and loads
(1) without a strategy, (2) under another strategy, and (3) saves a SavedModel with
`tf.saved_model.save` and loads it with `tf.saved_model.load` for inference.

What changed: `tf.distribute.MirroredStrategy()` -> `stratkit.make_strategy()`; in a
cluster only the chief writes the real path (the others save to a temporary
directory), and Keras 3 writes a SavedModel with `model.export(path)` (the loaded
object's `serve` signature replaces `loaded.signatures["serving_default"]`).
    python examples/tutorials/save_load.py
    stratkit launch --workers 2 -- python examples/tutorials/save_load.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

import stratkit

from _digits import build_model, load_digits_split, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stratkit-tutorial-save-load"))
    args = parser.parse_args()

    strategy = stratkit.make_strategy()          # was: tf.distribute.MirroredStrategy()
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    x, y, x_test, y_test = load_digits_split()
    batch = 32 * strategy.num_replicas_in_sync
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def compile_model(model):
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(3e-3), metrics=["accuracy"])
        return model

    with strategy.scope():
        model = compile_model(build_model())
    model.fit(train_dataset, epochs=args.epochs)
    _, trained_acc = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)

    # Only the chief writes where asked; another worker writes a private copy (same bytes).
    out = args.out if strategy.extended.should_checkpoint else tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)             # Keras's model.save does not create folders
    keras_path = os.path.join(out, "model.keras")
    saved_model_path = os.path.join(out, "saved_model")
    model.save(keras_path)
    model.export(saved_model_path, verbose=False)  # was: tf.saved_model.save(model, path)

    # (1) Load without a strategy and keep training.
    restored = keras.models.load_model(keras_path)
    _, restored_acc = restored.evaluate(x_test, y_test, verbose=0)
    restored.fit(x, y, epochs=1, batch_size=64, verbose=0)
    # (2) Load under another strategy.
    another_strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with another_strategy.scope():
        in_other = keras.models.load_model(keras_path)
    _, other_acc = in_other.evaluate(x_test, y_test, verbose=0)
    # (3) The SavedModel, for inference without Keras.
    loaded = tf.saved_model.load(saved_model_path)
    saved_model_acc = float(np.mean(np.argmax(loaded.serve(tf.constant(x_test)).numpy(), axis=1) == y_test))

    report(tutorial="save_load", replicas=strategy.num_replicas_in_sync,
           chief=bool(strategy.extended.should_checkpoint), trained_accuracy=float(trained_acc),
           loaded_accuracy=float(restored_acc), other_strategy_accuracy=float(other_acc),
           saved_model_accuracy=saved_model_acc)


if __name__ == "__main__":
    main()
