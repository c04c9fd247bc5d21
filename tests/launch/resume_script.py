"""A Trainer script that dies once and resumes: run alone, or as every task of a launched cluster.

Adam (optimizer state), shuffled data (the order must carry on), a global batch
that does not divide the data (an uneven last batch), `backup_dir` from argv[1].
With DIE_AFTER_EPOCH=E, worker 1 exits 3 right after epoch E's backup, on the
first attempt only (STRATKIT_RESTART_COUNT). Prints `RESULT {"w": [...], "loss": [...]}`.
"""

import json
import os
import sys

import stratkit

trainer = stratkit.Trainer()
spec = stratkit.detect()

import keras  # noqa: E402
import numpy as np  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "4"))
rng = np.random.default_rng(0)
x = rng.normal(size=(150, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1)) + 0.3).astype("float32")


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class DieOnce(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if (os.environ.get("DIE_AFTER_EPOCH") and epoch + 1 == int(os.environ["DIE_AFTER_EPOCH"])
                and spec.worker_rank == 1 and os.environ.get("STRATKIT_RESTART_COUNT", "0") == "0"):
            print(f"worker 1 dies after epoch {epoch + 1}", flush=True)
            os._exit(3)


model = trainer.build(build)
history = trainer.fit(model, (x, y), epochs=EPOCHS, global_batch_size=32, backup_dir=sys.argv[1],
                      callbacks=[DieOnce()], verbose=0, shuffle=os.environ.get("SHUFFLE", "1") == "1")
weights = [float(v) for w in model.get_weights() for v in np.ravel(w)]
print("RESULT " + json.dumps({"w": weights, "loss": history.history["loss"]}), flush=True)
