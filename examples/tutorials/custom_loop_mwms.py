"""Port of "Custom training loop with Keras and MultiWorkerMirroredStrategy"
(tensorflow/docs, tutorials/distribute/multi_worker_with_ctl.ipynb).

The tutorial: MultiWorkerMirroredStrategy, `distribute_datasets_from_function` with
a per-replica batch and a shard per input pipeline, a `strategy.run` step that
scales the loss with `tf.nn.compute_average_loss`, a Keras accuracy metric, and a
`tf.train.CheckpointManager` that writes to the real directory on the chief and to
a temporary directory (deleted after each save) on the other workers; the run
resumes from the latest checkpoint.

What changed: `tf.distribute.MultiWorkerMirroredStrategy()` -> `stratkit.make_strategy()`;
the tutorial's `_is_chief(task_type, task_id)` -> `stratkit.detect().is_chief`.
    python examples/tutorials/custom_loop_mwms.py
    stratkit launch --workers 2 -- python examples/tutorials/custom_loop_mwms.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

import stratkit

from _digits import build_model, load_digits_split, report

PER_WORKER_BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stratkit-tutorial-ctl"))
    args = parser.parse_args()

    strategy = stratkit.make_strategy()          # was: tf.distribute.MultiWorkerMirroredStrategy()
    spec = stratkit.detect()
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    x, y, x_test, y_test = load_digits_split()
    global_batch = PER_WORKER_BATCH * spec.num_workers

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    multi_worker_dataset = strategy.distribute_datasets_from_function(dataset_fn)

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.1)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(iterator):
        def step_fn(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                per_example_loss = loss_object(labels, predictions)
                loss = tf.nn.compute_average_loss(per_example_loss)   # divides by the global batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_accuracy.update_state(labels, predictions)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    # Keras 3 keeps its step count in the optimizer; the tutorial's own counters stay tf.Variables.
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint_dir = os.path.join(args.out, "ckpt")
    # The tutorial's write_filepath(): the chief writes checkpoint_dir, the others a temp dir.
    write_dir = checkpoint_dir if spec.is_chief else tempfile.mkdtemp(prefix=f"worker-{spec.task_index}-")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch)
    manager = tf.train.CheckpointManager(checkpoint, directory=write_dir, max_to_keep=1)
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    if latest:
        checkpoint.restore(latest)
    resumed_at = int(epoch.numpy())

    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    while epoch.numpy() < args.epochs:
        total_loss, num_batches = 0.0, 0
        while step_in_epoch.numpy() < args.steps:
            total_loss += float(train_step(iterator))
            num_batches += 1
            step_in_epoch.assign_add(1)
        total_loss /= num_batches
        accuracy = float(train_accuracy.result())
        print(f"Epoch: {int(epoch.numpy())}, accuracy: {accuracy:.4f}, train_loss: {total_loss:.4f}", flush=True)
        train_accuracy.reset_state()
        epoch.assign_add(1)
        step_in_epoch.assign(0)
        manager.save()                            # every worker saves: the save is a collective
        if not spec.is_chief:
            tf.io.gfile.rmtree(write_dir)

    # Held-out accuracy, computed the same way on every worker (no collective needed).
    predicted = tf.argmax(model(x_test, training=False), axis=1).numpy()
    report(tutorial="custom_loop_mwms", workers=spec.num_workers, chief=spec.is_chief, resumed_at=resumed_at,
           steps=int(optimizer.iterations.numpy()), loss=float(total_loss),
           eval_accuracy=float((predicted == y_test).mean()))


if __name__ == "__main__":
    main()
