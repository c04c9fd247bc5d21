"""One training job of bench_scaling.py: a ResNet-style model on synthetic images through stratkit.

Runs unchanged as a single process (no TF_CONFIG: stratkit picks one_device)
or as every worker of a `stratkit.launch.launch(..., workers=2)` cluster
(MultiWorkerMirrored). Its configuration comes as JSON in
STRATKIT_BENCH_SCALING; thread counts come from the environment
(TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS / OMP_NUM_THREADS), exactly
as `stratkit launch` sets them.

Timing: wall-clock (time.time(), comparable across processes on one host) at
each epoch's begin and end, from an epoch-level callback only (a per-batch
hook would make Keras synchronise after every step). Epoch 0 traces the
graph and is warm-up. With "barrier": true the job prints READY after epoch
0 and blocks until the parent writes a line to its stdin, so jobs that must
run at the same time start their measured epochs together.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import stratkit

config = json.loads(os.environ["STRATKIT_BENCH_SCALING"])
spec = stratkit.detect()
options = {}
if spec.strategy == "multi_worker_mirrored" and config.get("bytes_per_pack"):
    options["bytes_per_pack"] = int(config["bytes_per_pack"])
if spec.strategy == "multi_worker_mirrored" and config.get("gradient_compression"):
    options["gradient_compression"] = config["gradient_compression"]
trainer = stratkit.Trainer(**options)  # first: the strategy must exist before any TensorFlow op

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from resnet_synthetic import resnet, synthetic_images  # noqa: E402

per_replica = int(config["per_replica_batch"])
global_batch = per_replica * trainer.num_replicas


def dataset_fn(input_context):
    # Each worker makes its own distinct images (seeded by its pipeline id) and
    # batches them per replica: the input costs the same in every configuration.
    batch = input_context.get_per_replica_batch_size(global_batch)
    x, y = synthetic_images(int(config["examples_per_worker"]), int(config["image"]), int(config["classes"]),
                            seed=input_context.input_pipeline_id)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    if config["prefetch"]:
        dataset = dataset.prefetch(tf.data.AUTOTUNE)  # what stratkit's own input path does
    return dataset


def build_and_compile():
    model = resnet(int(config["image"]), int(config["classes"]), int(config["width"]),
                   [int(b) for b in config["blocks"]])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class EpochClock(keras.callbacks.Callback):
    def __init__(self, barrier: bool) -> None:
        super().__init__()
        self.barrier = barrier
        self.epochs: list[list[float]] = []
        self.cpu: list[list[float]] = []   # this process's CPU seconds at each epoch's begin and end

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([time.time(), 0.0])
        self.cpu.append([time.process_time(), 0.0])

    def on_epoch_end(self, epoch, logs=None):
        self.epochs[-1][1] = time.time()
        self.cpu[-1][1] = time.process_time()
        if epoch == 0 and self.barrier:
            print("READY", flush=True)
            sys.stdin.readline()  # the parent says GO once every job of the group is ready


model = trainer.build(build_and_compile)
clock = EpochClock(bool(config.get("barrier")))
trainer.fit(model, dataset_fn, epochs=int(config["epochs"]), steps_per_epoch=int(config["steps"]),
            callbacks=[clock], verbose=0)
result = {"rank": max(spec.worker_rank, 0), "strategy": spec.strategy, "replicas": trainer.num_replicas,
          "global_batch": global_batch, "steps": int(config["steps"]), "epochs": clock.epochs, "cpu": clock.cpu,
          "params": int(model.count_params()),
          "gradient_bytes": int(sum(np.prod(v.shape) * 4 for v in model.trainable_variables)),
          "gradient_tensors": len(model.trainable_variables),
          "gradient_compression": options.get("gradient_compression"),
          "threads": {k: os.environ.get(k) for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
                                                     "OMP_NUM_THREADS")}}
with open(f"{config['result']}.{result['rank']}", "w") as handle:
    json.dump(result, handle)
