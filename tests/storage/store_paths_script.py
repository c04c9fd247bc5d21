"""One worker of tests/storage/test_store_paths_multiworker.py: saves and callbacks to store URLs on 2 workers.

Run with TF_CONFIG (2 workers), TEST_URLS (JSON: scheme -> a fresh URL prefix on that store's server) and
TEST_WORKDIR (this worker's own working directory). Prints one JSON line: what it saw.
"""

from __future__ import annotations

import json
import os

os.chdir(os.environ["TEST_WORKDIR"])   # relative paths (and a stray "s3:" directory) would land here

import numpy as np

import stratkit
from stratkit.errors import ConfigError

urls = json.loads(os.environ["TEST_URLS"])
s3, gs, az = urls["s3"], urls["gs"], urls["az"]
trainer = stratkit.Trainer(seed=0)
rank = trainer.spec.worker_rank
import keras
import tensorflow as tf


def build(seed):
    def make():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model
    return make


def weights(model):
    return [w.tolist() for w in model.get_weights()]


rng = np.random.default_rng(0)
x = rng.normal(size=(128, 4)).astype("float32")
y = rng.normal(size=(128, 2)).astype("float32")
report = {"rank": rank}

# -- the routed callbacks, to S3 (and one to GCS) ------------------------------------------------
model = trainer.build(build(0))
callbacks = [keras.callbacks.ModelCheckpoint(s3 + "/ckpt/{epoch}/m.weights.h5", save_weights_only=True),
             keras.callbacks.CSVLogger(s3 + "/logs/log.csv"),
             keras.callbacks.TensorBoard(s3 + "/tb"),
             keras.callbacks.BackupAndRestore(s3 + "/backup", delete_checkpoint=False),
             keras.callbacks.ModelCheckpoint(gs + "/best.keras", monitor="loss", save_best_only=True)]
trainer.fit(model, (x, y), epochs=2, global_batch_size=32, callbacks=callbacks, verbose=0)
report["paths_after_fit"] = [callbacks[0].filepath, callbacks[1].filename, callbacks[2].log_dir,
                             callbacks[3].backup_dir, callbacks[4].filepath]

# -- saves to every store: Trainer.save, and Keras's own under stratkit's save guards ---------------
report["trained"] = weights(model)
report["saved"] = {}
for scheme, base in urls.items():
    report["saved"][f"trainer-{scheme}"] = trainer.save(model, base + "/trainer/model.keras")
    model.save(base + "/keras/model.keras")
model.save_weights(az + "/keras/model.weights.h5")
model.export(s3 + "/export", verbose=False)
model.save("ram://memory/model.keras")   # a scheme only tf.io.gfile knows: Keras's own save, as plain Keras
report["ram_saved"] = bool(tf.io.gfile.exists("ram://memory/model.keras"))
try:
    trainer.save(model, "s3://no-such-bucket-here/model.keras")
except ConfigError as exc:
    report["missing_bucket"] = str(exc)

# -- BackupAndRestore read back from the store: a fresh model resumes where the first fit ended -------
fresh = trainer.build(build(1))
resumed = trainer.fit(fresh, (x, y), epochs=3, global_batch_size=32, verbose=0, shuffle=False,
                      callbacks=[keras.callbacks.BackupAndRestore(s3 + "/backup")])
continued = trainer.fit(model, (x, y), epochs=3, initial_epoch=2, global_batch_size=32, verbose=0, shuffle=False)
report["resumed_epochs"] = resumed.epoch
report["resumed"] = weights(fresh)
report["continued"] = weights(model)
print(json.dumps(report), flush=True)
