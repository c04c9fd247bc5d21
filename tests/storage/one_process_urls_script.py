"""Issue 49's script, for tests/storage/test_store_urls_one_process.py: a plain `model.fit` under
`stratkit.make_strategy()` with `ModelCheckpoint`, `CSVLogger(append=True)`, `TensorBoard` and `BackupAndRestore`
writing to a store URL. The same file runs as one process and as each worker of a cluster (TF_CONFIG).

Environment:
    BUCKET: the run's store root, e.g. ``s3://bkt`` (the callbacks write under it as in the issue).
    STOP_IN_EPOCH: (optional) in this epoch (1-based), after its second batch, write the file STOPPED and wait to
        be killed (the test sends SIGKILL); the rest of the script never runs.
    SAVES: (optional) JSON {"keras": url, "weights": url, "export": url}: after `fit`, `model.save`,
        `model.save_weights` and `model.export` there, each read back from the store and compared.
Prints one JSON line: the strategy, the trained weights and what the saves read back.
"""

from __future__ import annotations

import json
import os
import time

import stratkit

strategy = stratkit.make_strategy()

import keras
import numpy as np

BUCKET = os.environ["BUCKET"].rstrip("/")
EPOCHS = 5
x = np.linspace(-1.0, 1.0, 64 * 4, dtype="float32").reshape(64, 4)
y = np.stack([x.sum(axis=1), x[:, 0] * x[:, 1]], axis=1).astype("float32")


class WaitToBeKilled(keras.callbacks.Callback):
    """In epoch `epoch` (0-based), after its second batch: tell the test (a file), then wait for its SIGKILL."""

    def __init__(self, epoch: int, marker: str) -> None:
        super().__init__()
        self.epoch, self.marker, self.current = epoch, marker, -1

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.current == self.epoch and batch == 1:
            with open(self.marker, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(600)            # the test kills this process long before
            os._exit(3)


with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

callbacks = [keras.callbacks.ModelCheckpoint(f"{BUCKET}/ckpt/m-{{epoch:02d}}.keras"),
             keras.callbacks.CSVLogger(f"{BUCKET}/log.csv", append=True),
             keras.callbacks.TensorBoard(f"{BUCKET}/tb"),
             keras.callbacks.BackupAndRestore(f"{BUCKET}/bar")]
if os.environ.get("STOP_IN_EPOCH"):
    callbacks.append(WaitToBeKilled(int(os.environ["STOP_IN_EPOCH"]) - 1, "STOPPED"))
history = model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=2)
import tensorflow as tf

kind = next(name for name, cls in (("multi_worker_mirrored", tf.distribute.MultiWorkerMirroredStrategy),
                                   ("mirrored", tf.distribute.MirroredStrategy),
                                   ("one_device", tf.distribute.OneDeviceStrategy)) if isinstance(strategy, cls))
report = {"strategy": kind, "replicas": int(strategy.num_replicas_in_sync),
          "epochs": history.epoch, "weights": [w.tolist() for w in model.get_weights()],
          "paths_after_fit": [callbacks[0].filepath, callbacks[1].filename, callbacks[2].log_dir,
                              callbacks[3].backup_dir]}

if os.environ.get("SAVES"):
    saves = json.loads(os.environ["SAVES"])
    model.save(saves["keras"])
    model.save_weights(saves["weights"])
    model.export(saves["export"], verbose=False)
    expected = model(x[:8]).numpy()
    with stratkit.storage.local_copy(saves["keras"]) as path:
        report["keras"] = float(np.abs(keras.models.load_model(path)(x[:8]).numpy() - expected).max())
    like = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    with stratkit.storage.local_copy(saves["weights"]) as path:
        like.load_weights(path)
    report["weights_file"] = float(np.abs(like(x[:8]).numpy() - expected).max())
    with stratkit.storage.local_copy(saves["export"]) as path:
        exported = tf.saved_model.load(path)        # (kept: a dropped object's variables are deleted)
        served = exported.serve(tf.constant(x[:8])).numpy()
    report["export"] = float(np.abs(served - expected).max())
print(json.dumps(report), flush=True)
