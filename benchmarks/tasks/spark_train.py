"""The one training job bench_spark.py runs three ways (SparkRunner, the peer's runner, stratkit launch),
and bench_ray.py runs through Ray Train, RayRunner and SparkRunner.

A 2-layer MLP on synthetic digits-like data (64 features, 10 classes), global
batch = 32 per worker x workers, `epochs` x `steps` steps. Every variant
returns the same timestamps (time.time(), comparable across processes on one
host): process start, strategy ready, first step begun (batch 0 begin), first
step done (batch 1 begin; it includes tracing and the first collective),
training end, and each epoch's end (steady-state steps/s: the epochs after the
first). Only `on_train_batch_begin` and `on_epoch_end` are hooked: a batch-END
hook would make Keras synchronise after every step.

Run as a script (`stratkit launch --workers 2 -- python spark_train.py`), the
chief writes the result as JSON to the path in STRATKIT_BENCH_SPARK_RESULT.
"""

from __future__ import annotations

import time

FEATURES, CLASSES, HIDDEN, PER_WORKER_BATCH = 64, 10, 128, 32


def _data(examples: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    y = (x[:, :CLASSES].argmax(axis=1)).astype("int32")  # learnable
    return x, y


def _clock(keras):
    class FirstSteps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.first_begin = None
            self.first_done = None
            self.epoch_ends = []

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append(time.time())  # bench_ray's steady-state steps/s: epochs after the first

        def on_train_batch_begin(self, batch, logs=None):
            if self.first_begin is None:
                self.first_begin = time.time()
            elif self.first_done is None:
                self.first_done = time.time()

    return FirstSteps()


def train_stratkit(epochs: int, steps: int) -> dict:
    """Keras 3 through stratkit.Trainer: what SparkRunner and `stratkit launch` run."""
    started = time.time()
    import stratkit

    trainer = stratkit.Trainer()
    ready = time.time()
    import keras

    global_batch = PER_WORKER_BATCH * trainer.num_replicas
    x, y = _data(steps * global_batch)  # exactly `steps` global batches per epoch

    def build():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = trainer.build(build)
    clock = _clock(keras)
    history = trainer.fit(model, (x, y), epochs=epochs, global_batch_size=global_batch, callbacks=[clock],
                          verbose=0)
    return {"process_start": started, "strategy_ready": ready, "first_step_begin": clock.first_begin,
            "first_step_done": clock.first_done, "train_end": time.time(), "epoch_ends": clock.epoch_ends,
            "loss": [round(float(v), 4) for v in history.history["loss"]], "replicas": trainer.num_replicas,
            "strategy": trainer.spec.strategy, "keras": keras.__version__}


def train_peer(epochs: int, steps: int) -> dict:
    """Legacy Keras (TF_USE_LEGACY_KERAS=1, tf-keras) inside the peer's MirroredStrategyRunner scope.

    The runner creates the MultiWorkerMirroredStrategy and calls this inside
    its scope (use_custom_strategy=False), as its README shows.
    """
    started = time.time()
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    ready = time.time()
    keras = tf.keras
    global_batch = PER_WORKER_BATCH * strategy.num_replicas_in_sync
    x, y = _data(steps * global_batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(global_batch).repeat()
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = _clock(keras)
    history = model.fit(dataset, epochs=epochs, steps_per_epoch=steps, callbacks=[clock], verbose=0)
    return {"process_start": started, "strategy_ready": ready, "first_step_begin": clock.first_begin,
            "first_step_done": clock.first_done, "train_end": time.time(),
            "loss": [round(float(v), 4) for v in history.history["loss"]],
            "replicas": strategy.num_replicas_in_sync, "strategy": type(strategy).__name__,
            "keras": getattr(keras, "__version__", "tf-keras")}


if __name__ == "__main__":
    import json
    import os

    config = json.loads(os.environ["STRATKIT_BENCH_SPARK"])
    result = train_stratkit(config["epochs"], config["steps"])
    import stratkit

    if stratkit.detect().is_chief:
        with open(os.environ["STRATKIT_BENCH_SPARK_RESULT"], "w") as handle:
            json.dump(result, handle)
