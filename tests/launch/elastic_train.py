"""The training script of the elastic tests and benchmark: run unchanged as one process or under any world size.

    python elastic_train.py OUT BACKUP_DIR EPOCHS PAUSE [--every K] [--step-pause S] [--steps-log PATH]

Trains a small regression with stratkit.Trainer (global batch 8, 12 steps per
epoch, backup_dir), pausing PAUSE s after each epoch's backup so that a test
can change the membership mid-run. Prints `FIRST_STEP <unix time> replicas <n>
epoch <e>` at this process's first training step, `EPOCH <e> replicas <n>`
after each epoch, and writes OUT/result-<rank>.json with the final weights.

    --every K        Trainer.fit(backup_every=K): a backup every K global steps (default: after every epoch)
    --step-pause S   sleep S s before each step (an epoch then lasts long enough to change the membership mid-epoch)
    --steps-log PATH worker 0 appends `STEP <global step> replicas <n> pid <pid> time <unix time>` to PATH
                     after each step it trained: the steps a resumed world trains again are the ones logged twice
"""

from __future__ import annotations

import argparse
import json
import os
import time

import stratkit

trainer = stratkit.Trainer()

import keras  # noqa: E402
import numpy as np  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("backup")
parser.add_argument("epochs", type=int)
parser.add_argument("pause", type=float)
parser.add_argument("--every", type=int, default=None)
parser.add_argument("--step-pause", type=float, default=0.0)
parser.add_argument("--steps-log", default=None)
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32") + 0.1)[:, None].astype("float32")
STEPS = 96 // 8


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


model = trainer.build(build)
rank = max(trainer.spec.worker_rank, 0)


class Marks(keras.callbacks.Callback):
    first = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.first:
            self.first = False
            print(f"FIRST_STEP {time.time():.3f} replicas {trainer.num_replicas} epoch {self.epoch + 1}", flush=True)
        if args.step_pause:
            time.sleep(args.step_pause)

    def on_train_batch_end(self, batch, logs=None):
        if args.steps_log and rank == 0:  # `batch` goes on at the backup's step in a resumed epoch
            with open(args.steps_log, "a") as handle:
                handle.write(f"STEP {self.epoch * STEPS + batch} replicas {trainer.num_replicas} "
                             f"pid {os.getpid()} time {time.time():.3f}\n")

    def on_epoch_end(self, epoch, logs=None):  # after the Trainer's backup of this epoch
        print(f"EPOCH {epoch + 1} replicas {trainer.num_replicas}", flush=True)
        time.sleep(args.pause)


trainer.fit(model, (x, y), epochs=args.epochs, global_batch_size=8, shuffle=False, backup_dir=args.backup,
            backup_every=args.every, callbacks=[Marks()], verbose=0)
weights = [float(v) for array in model.get_weights() for v in np.ravel(array)]
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"result-{rank}.json"), "w") as handle:
    json.dump({"weights": weights, "replicas": trainer.num_replicas}, handle)
print(f"RESULT rank {rank} replicas {trainer.num_replicas}", flush=True)
