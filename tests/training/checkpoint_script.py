"""A Trainer run with step backups, EarlyStopping, ReduceLROnPlateau, ModelCheckpoint(best) and a CSVLogger.

Run alone (STRATEGY=one_device or mirrored, LOGICAL_CPUS=2) or as every task of
`stratkit launch`. 160 rows, global batch 16: epochs of 10 steps; Adam; shuffled
arrays. Environment:

  BACKUP_DIR, OUT       the backup directory; where results, logs and the best file go
  BACKUP_EVERY          Trainer.fit's backup_every (default 7; "" for epoch backups)
  KILL_AT, KILL_RANK    on the first attempt only (STRATKIT_RESTART_COUNT + ATTEMPT 0; or the attempt
  KILL_SIGNAL           KILL_ATTEMPT names), this rank signals itself before global step KILL_AT runs: KILL, or
                        TERM followed by a SIGKILL 5 s later (as a platform does); or EXTERNAL: it writes
                        ready-<rank>.json (its pid) and waits there (up to 120 s) for the file `sent`, which
                        the test writes after it signalled this process from outside (an engine's tests)
  HOLD_AT               rank 0's first attempt waits before global step HOLD_AT (up to 120 s) for the file `go`,
                        which the test writes once what it changed outside (a store back up) is in place
  DROPOUT               add a Dropout layer (random state must carry over; one strategy only)
  STEP_SECONDS          sleep this long after each step (a notice from outside then lands mid-run)
  STRATKIT_BACKUP_STAGING  with a store URL as BACKUP_DIR: "{rank}" in it is this worker's rank (a host's own disk)
  AFTER_NOTICE_SECONDS  on the rank that signals itself (TERM), sleep this long after each step once it has:
                        the steps after a notice take that long (every worker waits for it in the next step)
  ARTIFACTS             where best.weights.h5 and log.csv go (default OUT; a store URL on hosts without a shared disk)

Evidence it writes in OUT: hosts.log (one "attempt rank hostname" line per process, at its start),
steps-<rank>.log (one "attempt global_step" line per step trained, written
after the step; times-<rank>.log the same with the time it ended),
result-<rank>.json (weights, history, epochs, stopping epoch), signal-<rank>.json (when
the signal was sent), best.weights.h5 and log.csv (the chief's, in ARTIFACTS).
"""

import json
import os
import signal
import socket
import sys
import threading
import time

import stratkit

options = {"logical_cpus": int(os.environ["LOGICAL_CPUS"])} if os.environ.get("LOGICAL_CPUS") else {}
trainer = stratkit.Trainer(strategy=os.environ.get("STRATEGY") or None, **options)
spec = stratkit.detect()

import keras  # noqa: E402
import numpy as np  # noqa: E402

OUT = os.environ["OUT"]
ARTIFACTS = os.environ.get("ARTIFACTS") or OUT
RANK = max(spec.worker_rank, 0)
if "{rank}" in os.environ.get("STRATKIT_BACKUP_STAGING", ""):  # each worker's staging on a disk of its own
    os.environ["STRATKIT_BACKUP_STAGING"] = os.environ["STRATKIT_BACKUP_STAGING"].format(rank=RANK)
ATTEMPT = int(os.environ.get("STRATKIT_RESTART_COUNT", "0")) + int(os.environ.get("ATTEMPT", "0"))
with open(os.path.join(OUT, "hosts.log"), "a") as handle:  # where each attempt's worker ran (test hosts' names)
    handle.write(f"{ATTEMPT} {RANK} {socket.gethostname()}\n")
STEPS_PER_EPOCH = 10
rng = np.random.default_rng(0)
x = rng.normal(size=(160, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1)) + 0.3).astype("float32")


def build():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation="tanh")]
    if os.environ.get("DROPOUT"):
        layers.append(keras.layers.Dropout(0.3))
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model


class Evidence(keras.callbacks.Callback):
    """Log each trained step's global index; signal this process before step KILL_AT on the first attempt."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        step = self.epoch * STEPS_PER_EPOCH + batch
        if os.environ.get("HOLD_AT") and step == int(os.environ["HOLD_AT"]) and RANK == 0 and ATTEMPT == 0:
            go, waited = os.path.join(OUT, "go"), time.monotonic()
            while not os.path.exists(go) and time.monotonic() - waited < 120:
                time.sleep(0.02)
        if (ATTEMPT == int(os.environ.get("KILL_ATTEMPT", "0")) and os.environ.get("KILL_AT") and step == int(os.environ["KILL_AT"])
                and RANK == int(os.environ.get("KILL_RANK", "0"))):
            if os.environ.get("KILL_SIGNAL", "KILL") == "KILL":
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ["KILL_SIGNAL"] == "EXTERNAL":
                with open(os.path.join(OUT, f"ready-{RANK}.json"), "w") as handle:
                    json.dump({"pid": os.getpid(), "step": step}, handle)
                sent, waited = os.path.join(OUT, "sent"), time.monotonic()
                while not os.path.exists(sent) and time.monotonic() - waited < 120:
                    time.sleep(0.02)
                return
            with open(os.path.join(OUT, f"signal-{RANK}.json"), "w") as handle:
                json.dump({"time": time.time(), "step": step}, handle)
            deadline = threading.Timer(5.0, os.kill, (os.getpid(), signal.SIGKILL))  # the platform's deadline
            deadline.daemon = True
            deadline.start()
            self.noticed = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, batch, logs=None):
        with open(os.path.join(OUT, f"steps-{RANK}.log"), "a") as handle:
            handle.write(f"{ATTEMPT} {self.epoch * STEPS_PER_EPOCH + batch}\n")
        with open(os.path.join(OUT, f"times-{RANK}.log"), "a") as handle:  # when each step ended (time.time())
            handle.write(f"{ATTEMPT} {self.epoch * STEPS_PER_EPOCH + batch} {time.time():.3f}\n")
        slow = getattr(self, "noticed", False) and os.environ.get("AFTER_NOTICE_SECONDS")
        time.sleep(float(slow or os.environ.get("STEP_SECONDS", "0")))


stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=0.25)
# EXTRA_CALLBACKS: passed by a caller that runs this file with runpy (Ray Train's RayReportCallback).
callbacks = [*globals().get("EXTRA_CALLBACKS", []), Evidence(), stopper,
             keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=0.6),
             keras.callbacks.ModelCheckpoint(os.path.join(ARTIFACTS, "best.weights.h5"), monitor="loss",
                                             save_best_only=True, save_weights_only=True),
             keras.callbacks.CSVLogger(os.path.join(ARTIFACTS, "log.csv"))]
every = os.environ.get("BACKUP_EVERY", "7")
model = trainer.build(build)
history = trainer.fit(model, (x, y), epochs=int(os.environ.get("EPOCHS", "12")), global_batch_size=16,
                      backup_dir=os.environ["BACKUP_DIR"], backup_every=int(every) if every.isdigit() else (every or None),
                      callbacks=callbacks, verbose=0)
result = {"weights": [w.tolist() for w in model.get_weights()], "epochs": history.epoch,
          "history": {k: v for k, v in history.history.items() if k != "examples_per_sec"},
          "stopped_epoch": stopper.stopped_epoch, "attempt": ATTEMPT}
with open(os.path.join(OUT, f"result-{RANK}.json"), "w") as handle:
    json.dump(result, handle)
print("done", file=sys.stderr)
