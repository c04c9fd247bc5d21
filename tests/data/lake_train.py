"""Train from a table: run alone, as every task of `stratkit launch`, or as a LocalRunner's train_fn.

    python lake_train.py TABLE_URL [BACKUP_DIR]

Environment: LAKE_KIND (parquet, delta, tfrecord), LAKE_VERSION (a Delta version), LAKE_REPLICAS (Mirrored over
that many logical CPUs in one process), LAKE_EPOCHS (2),
LAKE_BATCH (256), LAKE_EVERY (backup_every, steps), LAKE_KILL_AT ("global step:rank:restart count", several
comma-separated: SIGKILL that worker right before that step, on that attempt), LAKE_WAIT (a file: wait for it to
appear before step 3, for a commit made while training). Prints `RESULT {"w", "h", "e", "ids", "resumed"}`: the
weights, the history, `Trainer.evaluate`'s scores of the trained model on the table, the row ids each epoch
trained on this worker (recorded inside the replica step) and the global step it started at (a resume's); with
LAKE_RESULT_DIR set, written to a file there and `RESULT {"file": path}` printed instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def train(table_url, backup_dir: str | None = None) -> dict:
    """`table_url`: a URL, or a `TableInput` handed over by a runner (trained with this script's order settings)."""
    import stratkit

    replicas = int(os.environ.get("LAKE_REPLICAS", "0"))    # one process, N logical CPUs under Mirrored
    trainer = stratkit.Trainer(strategy="mirrored", logical_cpus=replicas) if replicas else stratkit.Trainer()
    import keras
    import numpy as np
    import tensorflow as tf

    from stratkit.data import Table, TableInput

    kind = os.environ.get("LAKE_KIND", "parquet")
    if isinstance(table_url, TableInput):
        table = table_url.table
    elif kind == "delta":
        version = os.environ.get("LAKE_VERSION")
        table = Table.delta(table_url, version=int(version) if version else None)
    elif kind == "tfrecord":
        table = Table.tfrecord(table_url, features={
            "id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([3], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.float32)})
    else:
        table = Table.parquet(table_url)
    data = TableInput(table, features=["x", "id"], label="y", seed=11, lanes=int(os.environ.get("LAKE_LANES", "12")))
    epochs = int(os.environ.get("LAKE_EPOCHS", "2"))
    batch = int(os.environ.get("LAKE_BATCH", "256"))
    seen: list[np.ndarray] = []

    def record(ids):
        seen.append(ids.numpy().copy())
        return tf.constant(0, tf.int32)

    class Recorded(keras.Model):
        def train_step(self, data):
            (x, ids), _ = data[0], data[1:]
            tf.py_function(record, [ids], tf.int32)
            return super().train_step(data)

    def build():
        keras.utils.set_random_seed(5)
        x = keras.Input((3,), name="x")
        ids = keras.Input((), dtype="int64", name="id")
        hidden = keras.layers.Dense(8, activation="tanh")(x)
        zero = keras.layers.Lambda(lambda t: 0.0 * keras.ops.cast(keras.ops.expand_dims(t, -1) % 2, "float32"))(ids)
        out = keras.layers.Dense(1)(keras.layers.Add()([hidden, zero * hidden]))
        model = Recorded([x, ids], out)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    spec = trainer.spec
    kill = os.environ.get("LAKE_KILL_AT")
    first: list[int] = []
    wait = os.environ.get("LAKE_WAIT")

    class Events(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            seen.append(np.array([-1 - epoch]))  # an epoch marker in the id stream

        def on_train_batch_begin(self, batch_index, logs=None):
            steps = self.params["steps"]
            step = self.epoch * steps + batch_index
            first.append(step)
            for target in (kill.split(",") if kill else []):
                at, rank, attempt = (int(v) for v in target.split(":"))
                if step == at and max(spec.worker_rank, 0) == rank and \
                        int(os.environ.get("STRATKIT_RESTART_COUNT", "0")) == attempt:
                    print(f"worker {rank} killed before step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            if wait and batch_index == 3:
                while not os.path.exists(wait):
                    time.sleep(0.05)

    model = trainer.build(build)
    fit = {"backup_dir": backup_dir, "backup_every": int(os.environ["LAKE_EVERY"])} if backup_dir else {}
    history = trainer.fit(model, data, epochs=epochs, global_batch_size=batch, verbose=0, callbacks=[Events()], **fit)
    ids: dict[str, list[int]] = {}
    epoch = -1
    for chunk in seen:
        if len(chunk) == 1 and chunk[0] < 0:
            epoch = int(-chunk[0] - 1)
            continue
        ids.setdefault(str(epoch), []).extend(int(i) for i in chunk)
    h = {k: [float(v) for v in vs] for k, vs in history.history.items() if k != "examples_per_sec"}
    scores = trainer.evaluate(model, data, global_batch_size=batch)     # the trained model on the table, once over
    e = {k: float(v) for k, v in scores.items()}
    return {"w": [w.tolist() for w in model.get_weights()], "h": h, "e": e, "ids": ids,
            "rank": max(spec.worker_rank, 0), "epochs_run": len(history.history["loss"]), "first_step": first[0]}


if __name__ == "__main__":
    result = train(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    into = os.environ.get("LAKE_RESULT_DIR")    # a million ids make a line longer than a launcher forwards whole
    if into:
        path = os.path.join(into, f"rank{result['rank']}-{os.getpid()}.json")
        with open(path, "w") as out:
            json.dump(result, out)
        result = {"file": path}
    print("RESULT " + json.dumps(result), flush=True)
