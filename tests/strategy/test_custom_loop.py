"""A custom training loop (TensorFlow's custom-training-loop guide) on `logical_cpus` runs to the end.

Measured before the fix (TF 2.21, 2 cores): a distributed iterator created and
advanced inside one `tf.function` over 2 logical CPUs stalled for good in 3 of 3
runs with TensorFlow's default inter-op pool (one thread per core); with
TF_NUM_INTEROP_THREADS=3, 4 or 8 it finished in seconds. Each run is a fresh
process: the pool is fixed when TensorFlow's runtime starts.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from procs import describe, run_process

pytestmark = pytest.mark.slow

#: The machine's default thread settings: nothing inherited from the test's own environment.
_DEFAULT_THREADS = {"TF_NUM_INTEROP_THREADS": None, "TF_NUM_INTRAOP_THREADS": None, "OMP_NUM_THREADS": None}

_CUSTOM_LOOP = textwrap.dedent("""
    import json, stratkit
    strategy = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
    import numpy as np, tensorflow as tf, keras
    GLOBAL_BATCH = 16
    rng = np.random.RandomState(0)
    x = rng.rand(256, 8).astype("float32")
    y = rng.randint(0, 4, size=(256,)).astype("int64")

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(GLOBAL_BATCH)).repeat().prefetch(2)

    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)),
                                              global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_steps(dataset, steps):
        iterator = iter(dataset)  # created and advanced inside this one tf.function
        total = 0.0
        for _ in tf.range(steps):
            total += strategy.reduce("SUM", strategy.run(train_step, args=(next(iterator),)), axis=None)
        return total / tf.cast(steps, tf.float32)

    losses = [float(train_steps(dist_dataset, tf.constant(8))) for _ in range(2)]
    print(json.dumps({"losses": losses, "steps": int(optimizer.iterations.numpy()),
                      "inter_op": tf.config.threading.get_inter_op_parallelism_threads()}))
""")


def test_a_custom_loop_iterating_inside_a_tf_function_on_two_logical_cpus_finishes_every_time():
    for run in range(5):
        result = run_process(_CUSTOM_LOOP, env=_DEFAULT_THREADS, timeout=60)
        assert result.ok, f"run {run + 1} of 5:\n" + describe([result])
        report = result.last_json()
        assert report["steps"] == 16
        assert all(np.isfinite(v) for v in report["losses"])


def test_an_inter_op_pool_the_user_sized_is_left_as_it_is():
    result = run_process(textwrap.dedent("""
        import json, os, tensorflow as tf, stratkit
        tf.config.threading.set_inter_op_parallelism_threads(5)
        stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        print(json.dumps({"inter_op": tf.config.threading.get_inter_op_parallelism_threads()}))
    """), env=_DEFAULT_THREADS, timeout=60)
    assert result.ok, describe([result])
    assert result.last_json() == {"inter_op": 5}
    result = run_process(textwrap.dedent("""
        import json, tensorflow as tf, stratkit
        stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        print(json.dumps({"inter_op": tf.config.threading.get_inter_op_parallelism_threads()}))
    """), env={**_DEFAULT_THREADS, "TF_NUM_INTEROP_THREADS": "7"}, timeout=60)
    assert result.ok, describe([result])
    assert result.last_json() == {"inter_op": 0}  # 0: TensorFlow reads TF_NUM_INTEROP_THREADS itself
