"""How far N replicas end from one device where rounding is amplified: Adam near a saddle, float16 (docs/exact.md).

    python benchmarks/measure_exactness.py [--replicas 2] [--epochs 3]

Not a speed benchmark (not run by `make bench`): the numbers docs/exact.md quotes. In one process, each model
trains twice with the same global batch and the same initial weights: on one device, and on a MirroredStrategy
over N logical CPUs (stratkit's N-replica path, the one N workers take), and the largest weight difference and
the largest difference of the logged loss are printed for each variant:

* ``transformer``: a small Transformer encoder (embedding, 2-head attention, feed-forward, LayerNormalization,
  dropout 0) on a token-classification task, AdamW with a linear warmup; the same with SGD; the same AdamW in
  float64 (where the replicas' other summation order leaves ~1e-15).
* ``mlp``: a 64-128-128-10 classifier under ``mixed_float16`` with Adam, Adam with ``clipnorm``, Adam with
  ``gradient_accumulation_steps=2`` and SGD; and the float32 twin of the Adam run.

Writes benchmarks/results/exactness-r<replicas>-e<epochs>[-<only>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--replicas", type=int, default=2)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--only", default="", help="run the variants whose name contains this")
args = parser.parse_args()

import stratkit

replicated = stratkit.make_strategy(strategy="mirrored", logical_cpus=args.replicas)

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

ROWS, BATCH, VOCAB, LENGTH = 512, 32, 64, 16


def token_rows():
    rng = np.random.default_rng(1)
    x = rng.integers(1, VOCAB, size=(ROWS, LENGTH))
    y = ((x[:, :4] % 7).sum(axis=1) % 4).astype("int32")       # depends on a few positions: attention has to find them
    return x.astype("int32"), y


def transformer(optimizer):
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 32)(inputs)
    h = h + keras.layers.Embedding(LENGTH, 32)(keras.ops.arange(LENGTH))
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16, dropout=0.0)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def class_rows():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, 64)).astype("float32")
    y = np.argmax(x[:, :10] + 0.5 * rng.normal(size=(ROWS, 10)), axis=1).astype("int32")
    return x, y


def mlp(optimizer):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, dtype="float32")])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def warmup_adamw():
    steps = args.epochs * ROWS // BATCH
    schedule = keras.optimizers.schedules.CosineDecay(0.0, steps, warmup_target=3e-3, warmup_steps=steps // 4)
    return keras.optimizers.AdamW(schedule, weight_decay=1e-2)


VARIANTS = {  # name: (model, rows, optimizer, dtype policy)
    "transformer AdamW+warmup float32": (transformer, token_rows, warmup_adamw, "float32"),
    "transformer SGD float32": (transformer, token_rows, lambda: keras.optimizers.SGD(5e-2, momentum=0.9), "float32"),
    "transformer AdamW+warmup float64": (transformer, token_rows, warmup_adamw, "float64"),
    "mlp Adam mixed_float16": (mlp, class_rows, lambda: keras.optimizers.Adam(1e-3), "mixed_float16"),
    "mlp Adam+clipnorm mixed_float16": (mlp, class_rows, lambda: keras.optimizers.Adam(1e-3, clipnorm=1.0),
                                        "mixed_float16"),
    "mlp Adam+accumulation mixed_float16": (mlp, class_rows,
                                            lambda: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=2),
                                            "mixed_float16"),
    "mlp SGD mixed_float16": (mlp, class_rows, lambda: keras.optimizers.SGD(5e-2, momentum=0.9), "mixed_float16"),
    "mlp Adam float32": (mlp, class_rows, lambda: keras.optimizers.Adam(1e-3), "float32"),
}


def train(strategy, build, rows, optimizer, policy):
    keras.config.set_floatx("float64" if policy == "float64" else "float32")
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    x, y = rows()
    if policy == "float64":
        x = x if x.dtype.kind == "i" else x.astype("float64")
    with strategy.scope():
        model = build(optimizer())
    history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0)
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype("float64")
    return weights, np.asarray(history.history["loss"], "float64"), int(model.optimizer.iterations.numpy())


one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
rows_out = []
for name, (build, rows, optimizer, policy) in VARIANTS.items():
    if args.only not in name:
        continue
    started = time.time()
    w_one, loss_one, steps_one = train(one_device, build, rows, optimizer, policy)
    w_n, loss_n, steps_n = train(replicated, build, rows, optimizer, policy)
    row = {"variant": name, "replicas": args.replicas, "weights": float(np.max(np.abs(w_one - w_n))),
           "loss": float(np.max(np.abs(loss_one - loss_n))), "weight_scale": float(np.max(np.abs(w_one))),
           "applied_steps": [steps_one, steps_n], "seconds": round(time.time() - started, 1)}
    rows_out.append(row)
    print(json.dumps(row), flush=True)
keras.config.set_floatx("float32")
keras.config.set_dtype_policy("float32")
write_result(f"exactness-r{args.replicas}-e{args.epochs}{'-' + args.only.replace(' ', '_') if args.only else ''}",
             {"epochs": args.epochs, "rows": ROWS, "global_batch": BATCH, "results": rows_out})
