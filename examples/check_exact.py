"""Does your model train on N replicas as on one device? Train it both ways in this process and compare.

    python examples/check_exact.py

Trains the model below on one device and on a MirroredStrategy over 2 logical
CPUs of this process (stratkit's N-replica path, the same one N workers take),
with the same global batch, in float32 and in float64, with AdamW and with
SGD, and prints the largest weight difference of each pair. Put your own model
into `build` and your own rows into `rows` (a few hundred are enough).

How to read it (see docs/exact.md): in float64 the two runs agree to ~1e-15,
so stratkit computes one process's mathematics; in float32 the replicas sum a
batch's gradients in another order, which changes the last bits. SGD carries
that over as it is (~1e-7). Adam divides each gradient by its running size, so
where gradients nearly cancel (a saddle, a weight that hardly moves) a last-bit
difference can become a whole step: a float32 AdamW gap far above SGD's,
with float64 at ~1e-15, is that rounding, not a training difference.
"""

import json

import stratkit

# First, before any TensorFlow op: the logical CPUs are fixed when TensorFlow starts.
replicas = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH, EPOCHS = 32, 2


def rows():
    """The training rows (yours here): x and y as NumPy arrays."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 16))
    y = np.tanh(x[:, :4] @ rng.normal(size=(4, 1))) + 0.1 * rng.normal(size=(128, 1))
    return x, y


def build(optimizer):
    """Your model, compiled with `optimizer` (it is made in the strategy's scope)."""
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


OPTIMIZERS = {"adamw": lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-2),
              "sgd": lambda: keras.optimizers.SGD(3e-2, momentum=0.9)}


def trained_weights(strategy, floatx, optimizer):
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(floatx)                # every layer's variables and computations
    keras.utils.set_random_seed(0)                       # the same initial weights both ways
    x, y = rows()
    with strategy.scope():
        model = build(OPTIMIZERS[optimizer]())
    model.fit(x.astype(floatx), y.astype(floatx), batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return np.concatenate([np.ravel(w) for w in model.get_weights()]).astype("float64")


one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
gaps = {}
for floatx in ("float32", "float64"):
    for optimizer in OPTIMIZERS:
        difference = trained_weights(one_device, floatx, optimizer) - trained_weights(replicas, floatx, optimizer)
        gaps[f"{floatx} {optimizer}"] = float(np.max(np.abs(difference)))
        print(f"{floatx:8} {optimizer:6} largest weight difference, one device vs {replicas.num_replicas_in_sync} "
              f"replicas: {gaps[f'{floatx} {optimizer}']:.1e}", flush=True)
keras.config.set_floatx("float32")
keras.config.set_dtype_policy("float32")
print(json.dumps(gaps))
