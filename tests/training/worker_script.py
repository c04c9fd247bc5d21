"""One training script, run unchanged as a single process or as each task of a cluster.

Driven by environment variables so the tests can reuse it:
  MODE           "digits" (default) | "equivalence" | "shards" | "plain_fit"
  OUT            directory for this task's JSON report and artefacts
  EPOCHS         total epochs
  BACKUP_DIR     passed to trainer.fit(backup_dir=...)
  KILL_AT_EPOCH  SIGKILL this process after that epoch's backup (only on KILL_RANK)
  KILL_RANK      which worker rank kills itself (default 1)
  STRATEGY       explicit strategy kind; LOGICAL_CPUS for mirrored
  BATCH          per-replica batch size
"""

from __future__ import annotations

import json
import os
import signal
import sys

import stratkit

MODE = os.environ.get("MODE", "digits")
OUT = os.environ["OUT"]
EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCH = int(os.environ.get("BATCH", "16"))
options = {"logical_cpus": int(os.environ["LOGICAL_CPUS"])} if os.environ.get("LOGICAL_CPUS") else {}

if MODE == "plain_fit":
    # The user keeps calling model.fit; stratkit only made the strategy.
    strategy = stratkit.make_strategy(strategy=os.environ.get("STRATEGY"), **options)
    trainer = None
else:
    trainer = stratkit.Trainer(strategy=os.environ.get("STRATEGY"), **options)
    strategy = trainer.strategy
spec = stratkit.detect(strategy=os.environ.get("STRATEGY"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rank = max(spec.worker_rank, 0)
os.makedirs(OUT, exist_ok=True)
report_path = os.path.join(OUT, f"report-{rank}.json")


class KillAfterBackup(keras.callbacks.Callback):
    """Simulate a crash: SIGKILL right after an epoch's backup was written."""

    def on_epoch_end(self, epoch, logs=None):
        if os.environ.get("KILL_AT_EPOCH") and epoch + 1 == int(os.environ["KILL_AT_EPOCH"]) \
                and rank == int(os.environ.get("KILL_RANK", "1")):
            print(f"killing rank {rank} after epoch {epoch + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))  # one split, the same on every worker
    x = (data.data[order] / 16.0).astype("float32")
    y = data.target[order].astype("int32")
    return x[:1400], y[:1400], x[1400:], y[1400:]


def mlp(lr=0.01, optimizer="adam"):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(lr) if optimizer == "adam" else keras.optimizers.SGD(lr)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


if MODE == "digits":
    x, y, xt, yt = digits()
    model = trainer.build(mlp)
    side_effects = [keras.callbacks.TensorBoard(log_dir=os.path.join(OUT, "tensorboard")),
                    keras.callbacks.ModelCheckpoint(os.path.join(OUT, "checkpoints", "last.keras"))]
    history = trainer.fit(model, (x, y), epochs=EPOCHS, per_replica_batch_size=BATCH, validation_data=(xt, yt),
                          backup_dir=os.environ.get("BACKUP_DIR"), callbacks=[KillAfterBackup(), *side_effects])
    evaluation = trainer.evaluate(model, (xt, yt), per_replica_batch_size=BATCH)
    predictions = trainer.predict(model, xt, per_replica_batch_size=BATCH)
    saved = trainer.save(model, os.path.join(OUT, "model", "digits.keras"))
    if saved:
        np.save(os.path.join(OUT, "predictions.npy"), predictions)
    report = {"history": history.history, "epochs_run": len(history.history["loss"]), "evaluate": evaluation,
              "predict_shape": list(predictions.shape),
              "predict_accuracy": float((predictions.argmax(axis=1) == yt).mean()),
              "saved": saved, "is_chief": trainer.is_chief, "num_replicas": trainer.num_replicas,
              "pid": os.getpid()}

elif MODE == "equivalence":
    # Fixed data order (no shuffle), fixed init, plain SGD: data-parallel == single device.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    model = trainer.build(build)
    trainer.fit(model, (x, y), epochs=EPOCHS, per_replica_batch_size=BATCH, shuffle=False)
    report = {"weights": [w.tolist() for w in model.get_weights()], "num_replicas": trainer.num_replicas}

elif MODE == "shards":
    # Each replica records the ids of the examples it trains on (py_function runs on the
    # worker's host), so the test can count them per epoch across the cluster.
    seen: list[int] = []

    class Record(keras.layers.Layer):
        def call(self, inputs, training=None):
            if training:
                def log(ids):
                    seen.extend(int(i) for i in ids.numpy())
                    return np.int32(0)
                token = tf.py_function(log, [tf.cast(inputs[:, 0], tf.int64)], tf.int32)
                with tf.control_dependencies([token]):
                    return tf.identity(inputs[:, 1:])
            return inputs[:, 1:]

    n = int(os.environ.get("EXAMPLES", "200"))
    ids = np.arange(n, dtype="float32")
    x = np.stack([ids, np.ones(n, "float32")], axis=1)
    y = np.zeros((n, 1), "float32")

    def build():
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(Record()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model

    per_epoch: list[list[int]] = []

    class Split(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(list(seen))
            seen.clear()

    model = trainer.build(build)
    kind = os.environ.get("DATA_KIND", "numpy")
    data = (x, y) if kind == "numpy" else tf.data.Dataset.from_tensor_slices((x, y))
    trainer.fit(model, data, epochs=EPOCHS, per_replica_batch_size=BATCH, callbacks=[Split()])
    report = {"per_epoch": per_epoch}

elif MODE == "plain_fit":
    x, y, xt, yt = digits()
    with strategy.scope():
        model = mlp()
    global_batch = BATCH * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1400, seed=1).batch(global_batch)
    history = model.fit(dataset, epochs=EPOCHS, verbose=0)
    evaluation = model.evaluate(tf.data.Dataset.from_tensor_slices((xt, yt)).batch(global_batch), verbose=0,
                                return_dict=True)
    report = {"history": history.history, "evaluate": evaluation, "num_replicas": strategy.num_replicas_in_sync}

else:  # pragma: no cover
    sys.exit(f"unknown MODE {MODE}")

with open(report_path + ".tmp", "w") as handle:
    json.dump(report, handle)
os.replace(report_path + ".tmp", report_path)
print(json.dumps({"report": report_path}), flush=True)
