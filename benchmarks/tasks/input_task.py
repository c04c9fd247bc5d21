"""One process of bench_input.py: Parquet reader throughput vs the model's consumption rate, alternating.

    python input_task.py CONFIG_JSON

Both figures are measured in this one process, with the thread settings a
training worker gets (the parent sets them), in alternating rounds so machine
noise hits both alike:

* readers, as worker 0 of 2 reads its shard of a staged DataFrame:
  - "ParquetShard.dataset_fn": stratkit.spark's own DataFrame input path
    (`StagedData.shard(0, 2).dataset_fn(global_batch)` called with the
    InputContext a 2-worker strategy gives worker 0: pyarrow row-group reads,
    from_generator, shuffle, per-replica batches, prefetch), consumed for one
    epoch's steps by `Dataset.reduce` (no Python per batch);
  - "pyarrow read_table -> from_tensor_slices": the plain alternative (read
    the whole shard into memory, then batch), load time included;
* the model: `stratkit.Trainer(strategy="one_device")` fitting the same model
  on in-memory batches of the same per-replica size; examples/s of one epoch
  (timed by an epoch callback, so fit()'s set-up is not counted) per round,
  after a warm-up fit that traces. A worker of a 2-worker job consumes no faster than
  this (it also waits for the all-reduce), so reader/model is a lower bound.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

config = json.loads(sys.argv[1])
import stratkit  # noqa: E402

trainer = stratkit.Trainer(strategy="one_device")  # first: before any TensorFlow op

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tensorflow as tf  # noqa: E402

from stratkit.spark.data import StagedData  # noqa: E402

files = tuple((path, pq.ParquetFile(path).metadata.num_rows) for path in config["files"])
staged = StagedData(path=config["dir"], files=files, feature_cols=("features",), label_col="label",
                    feature_dtype="float32")
shard = staged.shard(0, 2)
per_replica = int(config["per_replica_batch"])
global_batch = per_replica * 2
steps = shard.steps_per_epoch(global_batch, 2)
context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=2)
dataset_fn = shard.dataset_fn(global_batch)


def count(dataset) -> int:
    return int(dataset.reduce(np.int64(0), lambda total, batch: total + tf.shape(batch[0], tf.int64)[0]))


def read_stratkit() -> float:
    start = time.perf_counter()
    rows = count(dataset_fn(context).take(steps))
    return rows / (time.perf_counter() - start)


def read_plain() -> float:
    start = time.perf_counter()
    x, y = shard.to_numpy()  # the same pyarrow reads, all at once
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica).prefetch(tf.data.AUTOTUNE)
    rows = count(dataset)
    return rows / (time.perf_counter() - start)


if config["model"] == "mlp":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spark_train import CLASSES, FEATURES, HIDDEN

    def build():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    shape = (FEATURES,)
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from resnet_synthetic import resnet

    def build():
        model = resnet(config["image"], 10, config["width"], config["blocks"])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    shape = (config["image"], config["image"], 3)

model = trainer.build(build)
model_steps = int(config["model_steps"])
rng = np.random.default_rng(0)
mx = rng.normal(size=(model_steps * per_replica, *shape)).astype("float32")
my = rng.integers(0, 10, size=model_steps * per_replica).astype("int32")


class EpochClock(keras.callbacks.Callback):
    """The epoch's own wall time: fit()'s set-up and tear-down are not consumption."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def consume() -> float:
    clock = EpochClock()
    trainer.fit(model, (mx, my), epochs=1, global_batch_size=per_replica, verbose=0, callbacks=[clock])
    return model_steps * per_replica / clock.seconds


# Warm-up: tracing, the page cache, the first pyarrow reads.
consume()
read_stratkit()
read_plain()
rates = {"stratkit": [], "plain": [], "model": []}
for i in range(int(config["rounds"])):
    order = [("stratkit", read_stratkit), ("plain", read_plain), ("model", consume)]
    for name, fn in order if i % 2 == 0 else order[::-1]:
        rates[name].append(fn())
print(json.dumps({"model": config["model"], "shard_rows": shard.num_rows, "steps_per_epoch": steps,
                  "per_replica_batch": per_replica, "params": int(model.count_params()),
                  "median": {k: statistics.median(v) for k, v in rates.items()}, "all": rates}))
