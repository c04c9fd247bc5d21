"""A callback of your own in stratkit's backups: `get_state()` / `set_state(dict)`.

Run it, then run it again after it stopped (`--stop-at 23` ends the first run
with a SIGKILL before global step 23, as a crash would): the second run resumes
at the newest step backup and the count goes on from the backup's, so it ends
with every step of the run counted once.

    python examples/callback_state.py --stop-at 23 ; python examples/callback_state.py
"""

import argparse
import os
import signal

import stratkit

trainer = stratkit.Trainer()

import keras  # noqa: E402
import numpy as np  # noqa: E402


class StepsSeen(keras.callbacks.Callback):
    """Counts the steps trained over the whole run, restarts included."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.count = 0
        self.stop_at = stop_at

    def on_train_batch_begin(self, batch, logs=None):
        if self.count == self.stop_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, for the demonstration

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1

    def get_state(self):               # saved in every backup (JSON-able values)
        return {"count": self.count}

    def set_state(self, state):        # given back when a run resumes from a backup
        self.count = state["count"]


parser = argparse.ArgumentParser()
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--backup-dir", default="backup")
args = parser.parse_args()


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


x = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")
seen = StepsSeen(args.stop_at)
trainer.fit(trainer.build(build), (x, x.sum(axis=1, keepdims=True)), epochs=5, global_batch_size=16,
            backup_dir=args.backup_dir, backup_every=7, callbacks=[seen], verbose=0)
print(f"steps counted: {seen.count}")  # 50 (5 epochs of 10 steps), resumed or not
