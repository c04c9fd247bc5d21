"""gradient_compression on 2 real MultiWorkerMirrored workers (processes on 127.0.0.1, TF_CONFIG).

Four runs of the same script, each a fresh pair of processes:
  * "none":      Trainer() without compression; the wrapper is never installed (upstream Keras).
  * "none+hook": the same, with the wrapper installed: must be bit-for-bit "none".
  * "bf16", "fp16": Trainer(gradient_compression=...).
Each run trains (a) a small regression with plain SGD in a fixed order for a fixed
number of steps (weights compared), (b) the digits MLP of examples/digits.py
(accuracy compared), and (c) traces one Keras train step to count its collectives.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from procs import describe, free_ports, run_cluster, worker_tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = textwrap.dedent("""
    import collections, json, os
    import stratkit
    from stratkit.strategy import compression

    mode = os.environ["MODE"]
    trainer = stratkit.Trainer(gradient_compression=None if mode.startswith("none") else mode)
    if mode == "none+hook":
        compression.install()
    import keras, numpy as np, tensorflow as tf
    from sklearn.datasets import load_digits

    # (a) fixed order, fixed init, plain SGD: the weights after STEPS steps.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

    def regression():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    model = trainer.build(regression)
    start = [w.copy() for w in model.get_weights()]
    epochs = int(os.environ["EPOCHS"])
    trainer.fit(model, (x, y), epochs=epochs, per_replica_batch_size=16, shuffle=False, verbose=0)
    weights = model.get_weights()

    # (b) digits, as examples/digits.py trains it (same split on every worker).
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    dx, dy = (data.data[order] / 16.0).astype("float32"), data.target[order].astype("int32")

    def mlp():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        net.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return net

    net = trainer.build(mlp)
    trainer.fit(net, (dx[:1400], dy[:1400]), epochs=int(os.environ["DIGITS_EPOCHS"]), per_replica_batch_size=16,
                verbose=0)
    accuracy = trainer.evaluate(net, (dx[1400:], dy[1400:]), per_replica_batch_size=16)["accuracy"]

    # (c) the collectives of one traced Keras train step on this worker (traced, not run).
    dataset = trainer.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((dx[:64], dy[:64])).batch(32))
    step = tf.function(lambda it: trainer.strategy.run(net.train_step, args=(next(it),)))
    graph = step.get_concrete_function(iter(dataset)).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    collectives = collections.Counter(f"{n.op}:{tf.as_dtype(n.attr['T'].type).name}" for n in nodes
                                      if n.op.startswith(("Collective", "Nccl")))
    print(json.dumps({"mode": mode, "installed": compression.installed(), "replicas": trainer.num_replicas,
                      "start": [w.tolist() for w in start], "weights": [w.tolist() for w in weights],
                      "steps": int(model.optimizer.iterations.numpy()), "accuracy": float(accuracy),
                      "gradient_tensors": len(net.trainable_variables), "collectives": collectives}))
""")

EPOCHS = 4          # regression: 256 examples / (2 workers x 16) = 8 steps per epoch -> 32 steps
DIGITS_EPOCHS = 6   # 1400 / 32 -> 44 steps per epoch


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    out = {}
    for mode in ("none", "none+hook", "bf16", "fp16"):
        results = run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), timeout=300, grace_after_failure=30,
                              env={"MODE": mode, "EPOCHS": str(EPOCHS), "DIGITS_EPOCHS": str(DIGITS_EPOCHS)})
        assert all(r.ok for r in results), describe(results)
        out[mode] = [r.last_json() for r in results]
    return out


def test_both_workers_train_the_same_model_in_every_mode(runs):
    for mode, (chief, worker) in runs.items():
        assert chief["replicas"] == 2 and chief["steps"] == EPOCHS * 8, mode
        assert chief["weights"] == worker["weights"], mode  # synchronous: identical on both workers
        assert chief["accuracy"] == worker["accuracy"], mode


def test_without_compression_the_weights_are_bit_for_bit_upstreams(runs):
    plain, hooked = runs["none"][0], runs["none+hook"][0]
    assert not plain["installed"] and hooked["installed"]
    assert hooked["weights"] == plain["weights"]  # exact, after 32 steps on 2 workers
    assert hooked["accuracy"] == plain["accuracy"]


@pytest.mark.parametrize("mode, tolerance", [("bf16", 0.02), ("fp16", 0.005)])
def test_compressed_weights_stay_within_tolerance_of_float32(runs, mode, tolerance):
    # Tolerance: the largest weight difference, relative to the largest change float32 training made
    # (bf16 keeps 8 mantissa bits, fp16 11: each gradient is rounded to ~0.4% / ~0.05%).
    got, want = runs[mode][0], runs["none"][0]
    assert got["installed"]
    for g, w, s in zip(got["weights"], want["weights"], want["start"]):
        g, w, s = np.array(g), np.array(w), np.array(s)
        assert not np.array_equal(g, w)  # the compressed all-reduce really ran
        assert np.abs(g - w).max() <= tolerance * np.abs(w - s).max(), (mode, np.abs(g - w).max(), np.abs(w - s).max())


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_digits_accuracy_within_one_point_of_float32(runs, mode):
    reference = runs["none"][0]["accuracy"]
    assert reference >= 0.9
    assert abs(runs[mode][0]["accuracy"] - reference) <= 0.01, (mode, runs[mode][0]["accuracy"], reference)


def test_one_packed_collective_carries_all_gradients_in_the_wire_dtype(runs):
    # The MLP has 4 gradient tensors; per worker, one step all-reduces them in ONE CollectiveReduceV2
    # (TF concatenates the list into one pack with the default bytes_per_pack=0). Compression changes
    # its dtype, not the count. The step's other collectives are left alone by compression: an int64 one,
    # the multi-worker distributed iterator summing how many replicas still have a batch
    # (tensorflow/python/distribute/input_lib.py, _calculate_replicas_with_values), and two small float32
    # ones of stratkit's exact path (keras_compat/global_gradient.py, synced_logs.py): the loss's global
    # (count, rows) and the metrics' summed state.
    assert runs["none"][0]["gradient_tensors"] == 4
    others = {"CollectiveReduceV2:int64": 1}
    assert runs["none"][0]["collectives"] == {"CollectiveReduceV2:float32": 3, **others}
    assert runs["none+hook"][0]["collectives"] == {"CollectiveReduceV2:float32": 3, **others}
    assert runs["bf16"][0]["collectives"] == {"CollectiveReduceV2:bfloat16": 1, "CollectiveReduceV2:float32": 2,
                                              **others}
    assert runs["fp16"][0]["collectives"] == {"CollectiveReduceV2:float16": 1, "CollectiveReduceV2:float32": 2,
                                              **others}
