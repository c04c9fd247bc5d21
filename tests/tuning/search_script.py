"""A seeded KerasTuner search for the tests: RandomSearch and Hyperband, one process or one tuner of N.

Every tuner prints `TRIAL <id> RUN <run> EPOCH <epoch> TUNER <tuner> PID <pid>` as each epoch of a trial
begins (the tests kill, stop and time tuners by these lines), and at the end one `RESULT {...}` line: each
search's trials (hyperparameter values, score), its best hyperparameters, and the best model's loss on the
validation data (`get_best_models()`, read back from the store).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import keras
import keras_tuner
import numpy as np

import stratkit

parser = argparse.ArgumentParser()
parser.add_argument("--search", choices=("random", "hyperband", "both"), default="both")
parser.add_argument("--trials", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--store", default=None)
parser.add_argument("--slow", type=float, default=0.0, help="seconds each epoch sleeps (room to kill a tuner)")
parser.add_argument("--build-fails-on", type=int, default=None, help="the build raises for this many units")
parser.add_argument("--signal-at", nargs="*", default=[],
                    help="TUNER:SIGNAL (1:KILL, 2:STOP): that tuner sends itself the signal on its first trial's "
                         "second-epoch line, at that point exactly (a test's own kill lands later on a loaded machine)")
args = parser.parse_args()
SIGNAL_AT = {int(t): getattr(signal, f"SIG{name}") for t, name in (item.split(":") for item in args.signal_at)}

TUNER: list = []


def build(hp):
    units = hp.Int("units", 4, 32, step=4)
    if units == args.build_fails_on:
        raise ValueError(f"no model with {units} units")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dropout(hp.Float("drop", 0.0, 0.5)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-3, 1e-1, sampling="log")), loss="mse")
    return model


class Trace(keras.callbacks.Callback):
    """Says which trial, run and epoch this tuner trains, at the epoch's second step (after the backups' own
    epoch-begin work: a tuner killed on this line has its last epoch's backup whole), and sleeps at each
    epoch's end with --slow (before the epoch's backup)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            state = TUNER[-1]._stratkit
            lease = state.current.lease
            print(f"TRIAL {lease.trial_id} RUN {lease.run} EPOCH {self.epoch} TUNER {state.session.tuner} "
                  f"PID {os.getpid()}", flush=True)
            if self.epoch == 1 and lease.run == 1 and state.session.tuner in SIGNAL_AT:
                os.kill(os.getpid(), SIGNAL_AT.pop(state.session.tuner))   # killed or hung mid-trial, here

    def on_epoch_end(self, epoch, logs=None):
        if args.slow:
            time.sleep(args.slow)


rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
xv = rng.normal(size=(64, 8)).astype("float32")
yv = (xv @ rng.normal(size=(8, 1))).astype("float32")


def run(tuner, name, **fit):
    TUNER.append(stratkit.tune(tuner, **({"store": f"{args.store}/{name}"} if args.store else {})))
    started = time.monotonic()
    TUNER[-1].search(x, y, batch_size=32, validation_data=(xv, yv), callbacks=[Trace()], verbose=0, **fit)
    seconds = time.monotonic() - started
    trials = {t.trial_id: [t.hyperparameters.values, t.score, t.status] for t in TUNER[-1].oracle.trials.values()}
    model = TUNER[-1].get_best_models()[0]
    return {"trials": trials, "best": TUNER[-1].get_best_hyperparameters()[0].values, "seconds": seconds,
            "model_loss": float(model.evaluate(xv, yv, verbose=0))}


result = {"tuner": None}
if args.search in ("random", "both"):
    result["random"] = run(keras_tuner.RandomSearch(build, objective="val_loss", max_trials=args.trials, seed=1,
                                                    directory="kt", project_name="random"), "random",
                           epochs=args.epochs)
if args.search in ("hyperband", "both"):
    result["hyperband"] = run(keras_tuner.Hyperband(build, objective="val_loss", max_epochs=3, factor=3, seed=2,
                                                    directory="kt", project_name="hyperband"), "hyperband")
result["tuner"] = TUNER[-1]._stratkit.session.tuner
print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
