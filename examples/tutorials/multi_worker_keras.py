"""Port of "Multi-worker training with Keras" (tensorflow/docs, tutorials/distribute/multi_worker_with_keras.ipynb).

The tutorial: TF_CONFIG written by hand for each worker, MultiWorkerMirroredStrategy,
global batch = per-worker batch x workers, a repeated dataset auto-sharded across
workers, model.fit(steps_per_epoch=...) with BackupAndRestore, and a model the chief
saves where asked while the other workers save to a temporary path they delete.

What changed: no TF_CONFIG to write (`stratkit launch` or your cluster sets it),
`tf.distribute.MultiWorkerMirroredStrategy()` -> `stratkit.make_strategy()`, and
`--trainer` shows the same run with `stratkit.Trainer` (backups, chief-only saving
and batch sizes handled for you).
    python examples/tutorials/multi_worker_keras.py
    stratkit launch --workers 2 -- python examples/tutorials/multi_worker_keras.py [--trainer]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import stratkit

from _digits import build_model, load_digits_split, report

PER_WORKER_BATCH = 32


def compile_model(model):
    import keras

    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"])
    return model


def with_make_strategy(args) -> dict:
    strategy = stratkit.make_strategy()          # was: tf.distribute.MultiWorkerMirroredStrategy()
    spec = stratkit.detect()                     # was: json.loads(os.environ["TF_CONFIG"])
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    global_batch = PER_WORKER_BATCH * spec.num_workers
    x, y, x_test, y_test = load_digits_split()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(global_batch)
    # In-memory data has no files to shard by: say DATA, as the tutorial's "auto-shard" section does.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)

    with strategy.scope():
        model = compile_model(build_model())
    # Every worker may pass the same path: stratkit gives non-chief workers a private copy.
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir=os.path.join(args.out, "backup"))]
    history = model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=callbacks)

    # The tutorial's write_filepath(): the chief writes the real path, the others a temp dir they delete.
    path = os.path.join(args.out, "model.keras")
    if not spec.is_chief:
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    if not spec.is_chief:
        shutil.rmtree(os.path.dirname(path))
    _, accuracy = model.evaluate(x_test, y_test, batch_size=global_batch, verbose=0)
    return dict(loss=float(history.history["loss"][-1]), eval_accuracy=float(accuracy), chief=spec.is_chief,
                workers=spec.num_workers)


def with_trainer(args) -> dict:
    trainer = stratkit.Trainer(seed=0)
    x, y, x_test, y_test = load_digits_split()
    model = trainer.build(lambda: compile_model(build_model()))
    history = trainer.fit(model, (x, y), epochs=args.epochs, steps_per_epoch=args.steps,
                          per_replica_batch_size=PER_WORKER_BATCH, backup_dir=os.path.join(args.out, "backup"))
    trainer.save(model, os.path.join(args.out, "model.keras"))
    accuracy = trainer.evaluate(model, (x_test, y_test), per_replica_batch_size=PER_WORKER_BATCH)["accuracy"]
    return dict(loss=float(history.history["loss"][-1]), eval_accuracy=float(accuracy), chief=trainer.is_chief,
                workers=trainer.spec.num_workers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps_per_epoch (the tutorial uses 70)")
    parser.add_argument("--trainer", action="store_true", help="use stratkit.Trainer instead of model.fit")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stratkit-tutorial-multi-worker"))
    args = parser.parse_args()
    numbers = with_trainer(args) if args.trainer else with_make_strategy(args)
    report(tutorial="multi_worker_keras", path="trainer" if args.trainer else "make_strategy", **numbers)


if __name__ == "__main__":
    main()
