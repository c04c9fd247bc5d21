"""The driver of tests/ray/test_ray_node_loss.py, run on test host h1 against the two-node Ray cluster.

    python ray_node_loss_driver.py ADDRESS WORK HOLD_AT

`RayRunner(num_workers=2, min_workers=1, max_retries=2)` runs `train` (a small `stratkit.Trainer` job,
`backup_dir` in WORK, which both hosts see: the test hosts share the file system). Every training process
appends one line per trained step to WORK/steps/<host>-<pid>.jsonl: the global step index (the optimizer's
`iterations` after the step, so it counts across a resume and does not depend on how the resume is made),
the epoch, the replicas and the wall time. That log is the evidence the test reads: which steps each attempt
trained, with how many replicas, and when. The first attempt holds after global step HOLD_AT until the test
has taken h2 away (WORK/lost).

Printed lines: `RUN {...}` (the chief's result and `runner.last_run`), or `FAILED {...}`, then
`SINGLE {...}`: the same job in one uninterrupted process (no TF_CONFIG, no pauses) for the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

#: The job: 96 rows, global batch 8 -> 12 steps per epoch.
EPOCHS = 6
GLOBAL_BATCH = 8
ROWS = 96
STEPS_PER_EPOCH = ROWS // GLOBAL_BATCH
#: `Trainer.fit(backup_every=...)`: a step backup every 5 global steps, so the retry resumes at the last one before
#: the loss (step 15 of 12-step epochs). None would back up after every epoch only.
BACKUP_EVERY: int | None = 5
#: Global steps between two backups: a retry resumes at a multiple of it and trains at most that many steps again.
STEPS_PER_BACKUP = BACKUP_EVERY or STEPS_PER_EPOCH


def train(work: str, epochs: int, pause: float, hold_at: int | None = None) -> dict:
    """One task's training: `Trainer.fit(backup_dir=WORK/backup)`, a step log, `pause` s after each step.

    With `hold_at`, a multi-worker run waits after that global step until WORK/lost exists (the test writes it
    once it has taken a host away), so the loss falls between two known steps however busy the machine is.
    """
    import socket
    import time

    import keras
    import numpy as np

    import stratkit

    trainer = stratkit.Trainer(seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32") + 0.1)[:, None].astype("float32")

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    model = trainer.build(build)
    steps = os.path.join(work, "steps")
    os.makedirs(steps, exist_ok=True)
    path = os.path.join(steps, f"{socket.gethostname()}-{os.getpid()}.jsonl")
    rank = max(trainer.spec.worker_rank, 0)

    class StepLog(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch + 1

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations)  # global steps trained so far, restored on a resume
            line = {"step": step, "epoch": self.epoch, "replicas": trainer.num_replicas, "rank": rank,
                    "host": socket.gethostname(), "t": time.time()}
            with open(path, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            if rank == 0:
                print(f"STEP {step} epoch {self.epoch} replicas {trainer.num_replicas}", flush=True)
            if step == hold_at and trainer.num_replicas > 1:
                deadline = time.monotonic() + 600
                while not os.path.exists(os.path.join(work, "lost")) and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(pause)

    every = {} if BACKUP_EVERY is None else {"backup_every": BACKUP_EVERY}
    trainer.fit(model, (x, y), epochs=epochs, global_batch_size=GLOBAL_BATCH, backup_dir=os.path.join(work, "backup"),
                callbacks=[StepLog()], verbose=0, **every)
    return {"weights": [float(v) for a in model.get_weights() for v in np.ravel(a)],
            "replicas": trainer.num_replicas, "host": socket.gethostname(), "steps": int(model.optimizer.iterations)}


def main(address: str, work: str, hold_at: int) -> None:
    import ray

    from stratkit.ray import RayRunner, RayTrainingError

    ray.init(address=address, _node_ip_address="198.18.0.1", log_to_driver=False)
    # One worker per node (STRICT_SPREAD); each node has 2 CPUs, so "how many workers fit" must count nodes.
    runner = RayRunner(num_workers=2, min_workers=1, max_retries=2, placement_strategy="STRICT_SPREAD", timeout=480)
    try:
        got = runner.run(train, work, EPOCHS, 0.05, hold_at)
        print("RUN " + json.dumps({"got": got, "report": dataclasses.asdict(runner.last_run)}), flush=True)
    except RayTrainingError as error:
        print("FAILED " + json.dumps({"error": str(error), "report": dataclasses.asdict(runner.last_run)}),
              flush=True)
    print("SINGLE " + json.dumps(train(os.path.join(work, "single"), EPOCHS, 0.0)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
