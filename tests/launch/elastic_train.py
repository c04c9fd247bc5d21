"""The training script of the elastic tests and benchmark: run unchanged as one process or under any world size.

    python elastic_train.py OUT BACKUP_DIR EPOCHS PAUSE

Trains a small regression with stratkit.Trainer (global batch 8, backup_dir),
pausing PAUSE s after each epoch's backup so that a test can change the
membership mid-run. Prints `FIRST_STEP <unix time> replicas <n> epoch <e>` at
this process's first training step, `EPOCH <e> replicas <n>` after each
epoch, and writes OUT/result-<rank>.json with the final weights.
"""

from __future__ import annotations

import json
import os
import sys
import time

import stratkit

trainer = stratkit.Trainer()

import keras  # noqa: E402
import numpy as np  # noqa: E402

out, backup, epochs, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32") + 0.1)[:, None].astype("float32")


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


model = trainer.build(build)


class Marks(keras.callbacks.Callback):
    first = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.first:
            self.first = False
            print(f"FIRST_STEP {time.time():.3f} replicas {trainer.num_replicas} epoch {self.epoch + 1}", flush=True)

    def on_epoch_end(self, epoch, logs=None):  # after the Trainer's backup of this epoch
        print(f"EPOCH {epoch + 1} replicas {trainer.num_replicas}", flush=True)
        time.sleep(pause)


trainer.fit(model, (x, y), epochs=epochs, global_batch_size=8, shuffle=False, backup_dir=backup,
            callbacks=[Marks()], verbose=0)
weights = [float(v) for array in model.get_weights() for v in np.ravel(array)]
rank = max(trainer.spec.worker_rank, 0)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"result-{rank}.json"), "w") as handle:
    json.dump({"weights": weights, "replicas": trainer.num_replicas}, handle)
print(f"RESULT rank {rank} replicas {trainer.num_replicas}", flush=True)
