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

if spec.is_chief:
    with open(config["result"], "w") as handle:
        json.dump({"workers": workers, "strategy": spec.strategy, "results": results,
                   "threads": {k: os.environ.get(k) for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}},
                  handle)
