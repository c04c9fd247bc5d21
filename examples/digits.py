"""Handwritten digits (scikit-learn's 8x8 digits, shipped inside the package: no download).

The same script runs unchanged:
    python examples/digits.py                              # one process
    stratkit launch --workers 2 -- python examples/digits.py   # 2 workers (MultiWorkerMirrored)
    TF_CONFIG='{"cluster": ..., "task": ...}' python examples/digits.py  # any TF_CONFIG cluster
    stratkit launch --chief --workers 2 --ps 1 -- python examples/digits.py --l2 1e-4  # parameter servers
"""

from __future__ import annotations

import argparse
import json

import stratkit


def load_digits_split(test_size: int = 397):
    """Return (x_train, y_train, x_test, y_test): x scaled to [0, 1] float32, a fixed shuffled split."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))  # same split on every worker
    x = (data.data[order] / 16.0).astype("float32")
    y = data.target[order].astype("int32")
    return x[:-test_size], y[:-test_size], x[-test_size:], y[-test_size:]


def build_and_compile(l2: float = 0.0):
    import keras

    regularizer = keras.regularizers.L2(l2) if l2 else None  # on every Dense layer's kernel
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--backup-dir", default=None, help="back up every epoch; resume here after a failure")
    parser.add_argument("--save", default=None, help="where the chief saves the trained .keras model")
    parser.add_argument("--l2", type=float, default=0.0, help="L2 weight regularization on every Dense layer")
    parser.add_argument("--steps-per-epoch", type=int, default=None,
                        help="default: one pass over the data (parameter servers: examples // global batch)")
    args = parser.parse_args(argv)

    trainer = stratkit.Trainer()          # first: the strategy must exist before any TF op
    x, y, x_test, y_test = load_digits_split()
    model = trainer.build(lambda: build_and_compile(args.l2))
    steps = args.steps_per_epoch
    if steps is None and trainer.spec.strategy == "parameter_server":  # PS schedules a fixed number of steps
        steps = len(x) // (args.per_replica_batch * trainer.num_replicas)
    trainer.fit(model, (x, y), epochs=args.epochs, per_replica_batch_size=args.per_replica_batch,
                steps_per_epoch=steps, validation_data=(x_test, y_test), backup_dir=args.backup_dir)
    metrics = trainer.evaluate(model, (x_test, y_test), per_replica_batch_size=args.per_replica_batch)
    if args.save:
        trainer.save(model, args.save)
    result = {"held_out_accuracy": round(float(metrics["accuracy"]), 4), "strategy": trainer.spec.strategy,
              "workers": trainer.spec.num_workers, "replicas": trainer.num_replicas}
    if trainer.is_chief:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
