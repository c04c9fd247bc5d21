"""Overhead: stratkit's `trainer.fit` vs hand-written `strategy.scope()` + `model.fit`.

Same model, same data, same global batch, same strategy object, in one process;
the two are run in alternating rounds so machine noise hits both alike. The
figure is the ratio of median steps/sec (goal: stratkit >= 0.97 of hand-written,
i.e. overhead <= 3%). One child process per strategy kind, because logical CPU
devices for "mirrored" must be configured before TensorFlow starts.

The last row is one_device with `Trainer(gradient_compression="bf16")`: on one
device there is no all-reduce, so the option must cost nothing (stratkit does
not even install its wrapper there; the row records that).

Each row also gives the spread: the ratio of each round (both measured back to
back, in alternating order) with its mean, min and max, and the 1-minute load
average before and after the row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

CHILD = r"""
import json, os, sys, time, statistics
import stratkit
kind, rounds, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
compress = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "none" else None
options = {"logical_cpus": 2} if kind == "mirrored" else {}
trainer = stratkit.Trainer(strategy=kind, gradient_compression=compress, **options)
from stratkit.strategy import compression
import keras, numpy as np, tensorflow as tf

rng = np.random.default_rng(0)
n = steps * batch
x = rng.normal(size=(n, 256)).astype("float32")
y = rng.integers(0, 10, size=n).astype("int32")

def build():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

stratkit_model = trainer.build(build)
with trainer.strategy.scope():
    hand_model = build()
# What a careful user writes by hand: shuffled, globally batched, prefetched.
hand_data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=1).batch(batch).prefetch(tf.data.AUTOTUNE)

def run_stratkit():
    start = time.perf_counter()
    trainer.fit(stratkit_model, (x, y), epochs=1, global_batch_size=batch, verbose=0)
    return steps / (time.perf_counter() - start)

def run_hand():
    start = time.perf_counter()
    hand_model.fit(hand_data, epochs=1, verbose=0)
    return steps / (time.perf_counter() - start)

run_stratkit(); run_hand()   # warm-up: tracing and graph building are not steady state
import contextlib, io
s, h = [], []
for i in range(rounds):
    order = (run_stratkit, run_hand) if i % 2 == 0 else (run_hand, run_stratkit)
    for fn in order:
        with contextlib.redirect_stdout(io.StringIO()):
            rate = fn()
        (s if fn is run_stratkit else h).append(rate)
print(json.dumps({"kind": kind, "replicas": trainer.num_replicas, "stratkit_steps_per_sec": statistics.median(s),
                  "hand_steps_per_sec": statistics.median(h), "stratkit_all": s, "hand_all": h,
                  "gradient_compression": compress, "compression_wrapper_installed": compression.installed()}))
"""


def measure(kind: str, rounds: int, steps: int, batch: int, compress: str | None = None) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(rounds), str(steps), str(batch), compress or "none"],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"overhead benchmark for {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    # Short rounds swing +-20% on 2 shared cores; 9 rounds of 150 steps keep the median steady.
    rounds, steps, batch = (2, 5, 32) if args.quick else (9, 150, 128)
    load_before = os.getloadavg()
    rows = []
    for kind, compress in (("one_device", None), ("mirrored", None), ("one_device", "bf16")):
        load = os.getloadavg()
        r = measure(kind, rounds, steps, batch, compress)
        name = kind if compress is None else f"{kind}, gradient_compression={compress!r}"
        # Each round ran both, back to back in alternating order: its ratio is one sample of the spread.
        per_round = [a / b for a, b in zip(r["stratkit_all"], r["hand_all"])]
        rows.append({"strategy": name, "replicas": r["replicas"],
                     "stratkit steps/s": r["stratkit_steps_per_sec"], "hand steps/s": r["hand_steps_per_sec"],
                     "ratio": r["stratkit_steps_per_sec"] / r["hand_steps_per_sec"],
                     "round mean": statistics.fmean(per_round), "round min": min(per_round),
                     "round max": max(per_round), "rounds": len(per_round),
                     "load before": load[0], "load after": os.getloadavg()[0], "raw": r})
    print_table("trainer.fit vs strategy.scope() + model.fit (ratio of medians >= 0.97 is the goal; round "
                "mean/min/max: per-round ratios; load: 1-minute average)",
                [{k: v for k, v in row.items() if k != "raw"} for row in rows])
    payload = {"quick": args.quick, "rounds": rounds, "steps_per_round": steps, "global_batch": batch,
               "goal_ratio": 0.97, "rows": rows, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(f"wrote {write_result('overhead' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
