"""One worker of bench_allreduce.py: time MultiWorkerMirrored's all-reduce of one float32 tensor per size.

Run as every worker of `stratkit.launch.launch(..., workers=2)`. The strategy
comes from stratkit (TF_CONFIG -> MultiWorkerMirroredStrategy, ring
all-reduce over gRPC); the op is the one Keras' gradient aggregation uses:
`replica_context.all_reduce(SUM, tensor)` inside `strategy.run` inside a
`tf.function`. Per size: 2 warm-up calls (tracing, collective group and
instance set-up), a small all-reduce as a barrier, then `iters` calls each
timed on its own (an eager call of a tf.function returns when it has run).
Every worker runs the same sizes and counts (a collective needs all of
them); the chief writes the timings to STRATKIT_BENCH_ALLREDUCE["result"].

Gradient lists (config "lists"): the trainable variables' shapes of a
model (the scaling benchmark's conv net, or a large dense MLP), all-reduced
as ONE list per call, as Keras' gradient aggregation does, once per wire
dtype. Each call does exactly what
`gradient_compression` does around the all-reduce: cast the float32 list to
the wire dtype, all-reduce it (one pack), cast the sums back to float32
(float32: no cast). Dtypes alternate order between rounds so load drifts hit
them alike.
"""

from __future__ import annotations

import json
import os
import time

import stratkit

config = json.loads(os.environ["STRATKIT_BENCH_ALLREDUCE"])
options = {"bytes_per_pack": int(config["bytes_per_pack"])} if config.get("bytes_per_pack") else {}
strategy = stratkit.make_strategy(**options)  # first: before any TensorFlow op
spec = stratkit.detect()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


@tf.function
def all_reduce(x):
    def replica_fn(t):
        # tf.identity places the value on the replica's device: an input placeholder has none, and
        # all_reduce then fails with "destinations can not be empty" (gradients always have one).
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(t))

    return strategy.run(replica_fn, args=(x,))


def per_replica(elements: int):
    # A distributed value (placed on this worker's replica device), as gradients are inside Keras' step.
    return strategy.experimental_distribute_values_from_function(lambda _: tf.ones([elements], tf.float32))


def local(value):
    return strategy.experimental_local_results(value)[0]


small = per_replica(1)


def barrier() -> None:
    local(all_reduce(small)).numpy()


workers = spec.num_workers
results = []
for size, iters in config["sizes"]:
    x = per_replica(size // 4)
    for _ in range(2):
        out = local(all_reduce(x))
    correct = float(out[0]) == float(workers) and float(out[-1]) == float(workers)
    barrier()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = all_reduce(x)
        times.append(time.perf_counter() - start)
    results.append({"bytes": size, "iters": iters, "seconds": times, "correct": correct})
    del x, out

def gradient_shapes(spec: dict) -> list[tuple]:
    """The trainable variables' shapes of the model a gradient list stands for."""
    import sys
    from pathlib import Path

    import keras

    if spec["kind"] == "resnet":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from resnet_synthetic import resnet

        net = resnet(int(spec["image"]), int(spec["classes"]), int(spec["width"]), [int(b) for b in spec["blocks"]])
    else:  # "dense": an MLP, inputs -> hidden layers -> classes
        net = keras.Sequential([keras.Input((int(spec["inputs"]),))]
                               + [keras.layers.Dense(int(u), activation="relu") for u in spec["hidden"]]
                               + [keras.layers.Dense(int(spec["classes"]))])
    return [tuple(v.shape) for v in net.trainable_variables]


def list_all_reduce(wire):
    """One step's gradient all-reduce as `gradient_compression` makes it: cast, one packed SUM, cast back."""
    @tf.function
    def run(values):
        def replica_fn(*tensors):
            sent = [tf.cast(tf.identity(t), wire) for t in tensors]
            summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
            return [tf.cast(t, tf.float32) for t in summed]

        return strategy.run(replica_fn, args=tuple(values))

    return run


def time_gradient_list(spec: dict) -> list[dict]:
    """Each wire dtype's per-call times for one gradient list, dtypes alternating order between rounds."""
    shapes = gradient_shapes(spec)
    rng = tf.random.Generator.from_seed(1)
    local_grads = [rng.normal(shape) * 1e-2 for shape in shapes]  # gradient-sized values, same on every worker
    grads = strategy.experimental_distribute_values_from_function(lambda _: list(local_grads))
    dtypes = [str(d) for d in spec["dtypes"]]
    fns = {d: list_all_reduce(tf.as_dtype(d)) for d in dtypes}
    times: dict = {d: [[] for _ in range(int(spec["rounds"]))] for d in dtypes}
    errors = {}
    want = [g * workers for g in local_grads]
    for d in dtypes:
        fns[d](grads)
        out = [local(v) for v in fns[d](grads)]
        # Largest error relative to the largest sum: what the cast costs in precision.
        errors[d] = max(float(tf.reduce_max(tf.abs(o - w))) for o, w in zip(out, want)) / \
            max(float(tf.reduce_max(tf.abs(w))) for w in want)
    for r in range(int(spec["rounds"])):
        for d in (dtypes if r % 2 == 0 else dtypes[::-1]):
            barrier()
            for _ in range(int(spec["iters"])):
                start = time.perf_counter()
                fns[d](grads)
                times[d][r].append(time.perf_counter() - start)
    values = int(sum(int(np.prod(s)) for s in shapes))
    return [{"list": spec["name"], "dtype": d, "tensors": len(shapes), "values": values,
             "bytes_on_wire": values * tf.as_dtype(d).size, "round_seconds": times[d], "max_relative_error": errors[d]}
            for d in dtypes]


gradients = [row for spec in config.get("lists", []) for row in time_gradient_list(spec)]

if spec.is_chief:
    with open(config["result"], "w") as handle:
        json.dump({"workers": workers, "strategy": spec.strategy, "results": results, "gradients": gradients,
                   "threads": {k: os.environ.get(k) for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}},
                  handle)
