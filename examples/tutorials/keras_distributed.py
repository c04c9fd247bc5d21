"""Port of "Distributed training with Keras" (tensorflow/docs, tutorials/distribute/keras.ipynb).

The tutorial: MirroredStrategy, a batched tf.data input with the global batch,
model.fit with TensorBoard, ModelCheckpoint, a LearningRateScheduler and a
print-the-LR callback, then restore the latest checkpoint, evaluate, and
save/load the model with and without the strategy.

What changed: `tf.distribute.MirroredStrategy()` -> `stratkit.make_strategy()`.
The same script then also runs as a cluster:
    python examples/tutorials/keras_distributed.py
    stratkit launch --workers 2 -- python examples/tutorials/keras_distributed.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

import stratkit

from _digits import build_model, load_digits_split, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stratkit-tutorial-keras"))
    args = parser.parse_args()

    strategy = stratkit.make_strategy()              # was: tf.distribute.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)                   # same initial weights on every worker
    x, y, x_test, y_test = load_digits_split()
    batch_size = args.per_replica_batch * strategy.num_replicas_in_sync  # BATCH_SIZE_PER_REPLICA x replicas
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    eval_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size)

    with strategy.scope():
        model = build_model()
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(3e-3), metrics=["accuracy"])

    def decay(epoch: int) -> float:
        return 3e-3 if epoch < 2 else 1e-3

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            # A callback of your own that only prints needs nothing; one that writes files must
            # write only where strategy.extended.should_checkpoint is true.
            if strategy.extended.should_checkpoint:
                print(f"Learning rate for epoch {epoch + 1} is {float(model.optimizer.learning_rate.numpy()):.4g}")

    checkpoint_dir = os.path.join(args.out, "training_checkpoints")
    # Keras 3: a weights-only checkpoint must end in ".weights.h5" (the tutorial's "ckpt_{epoch}" is refused).
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")
    callbacks = [
        keras.callbacks.TensorBoard(log_dir=os.path.join(args.out, "logs")),
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]
    history = model.fit(train_dataset, epochs=args.epochs, callbacks=callbacks)

    # Restore the latest checkpoint (Keras 3: a file path, not tf.train.latest_checkpoint) and evaluate.
    model.load_weights(checkpoint_prefix.format(epoch=args.epochs))
    _, eval_acc = model.evaluate(eval_dataset, verbose=0)

    # Save, then load without a strategy and under the strategy. Only the chief writes the file;
    # the others save to a private temporary directory (stratkit.Trainer.save does the same).
    path = os.path.join(args.out, "model.keras")
    if not strategy.extended.should_checkpoint:
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    unreplicated = keras.models.load_model(path)
    unreplicated.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    _, plain_acc = unreplicated.evaluate(eval_dataset, verbose=0)
    with strategy.scope():
        replicated = keras.models.load_model(path)
    _, replicated_acc = replicated.evaluate(eval_dataset, verbose=0)

    report(tutorial="keras", replicas=strategy.num_replicas_in_sync, chief=bool(strategy.extended.should_checkpoint),
           loss=float(history.history["loss"][-1]), eval_accuracy=float(eval_acc),
           loaded_accuracy=float(plain_acc), loaded_in_scope_accuracy=float(replicated_acc))


if __name__ == "__main__":
    main()
