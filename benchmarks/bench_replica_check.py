"""The replica check's cost: one epoch of `fit` with the check (the default) vs `STRATKIT_REPLICA_CHECK=off`.

The check runs before a fit's first step, at every epoch's end and at the end of fit
(stratkit/strategy/replica_check.py): per variable two int64 fingerprints, one all_gather; a one-epoch fit runs
it three times. The check before the first step is what it adds per fit: one `check()` call. Two models: the MLP of bench_overhead (4 variables, 0.4M parameters) and a
small ResNet with BatchNormalization (bench_scaling's shape: 9 BatchNorm layers, 50 variables). Two strategies:
a local Mirrored over 2 logical CPUs and 2 MultiWorkerMirrored workers on 127.0.0.1. In each process the two
settings alternate round by round (the env var is read at each fit), so machine noise hits both alike; also the
time of one `check()` call on its own (median of 10) and its share of an epoch without it: the figure that a
busy machine moves least (the epoch ratios spread by tens of percent at load 12-17). Reported per row: mean and
spread of the rounds' ratio (epoch time with the check / without), the check's own time and share, and the
load average before and after.
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
from jobs import REPO, clean_env, loopback_ports  # noqa: E402

CHILD = r"""
import json, os, sys, time, statistics
import stratkit
kind, model_name, rounds, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
trainer = stratkit.Trainer(strategy="mirrored", logical_cpus=2) if kind == "mirrored" else stratkit.Trainer()
import keras, numpy as np
from stratkit.strategy import replica_check

batch = 32
rng = np.random.default_rng(0)
if model_name == "mlp":
    x = rng.normal(size=(steps * batch, 256)).astype("float32")
    def build():
        m = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
else:
    x = rng.normal(size=(steps * batch, 16, 16, 3)).astype("float32")
    def block(h, filters):
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y))
        return keras.layers.ReLU()(keras.layers.Add()([h, y]))
    def build():
        inputs = keras.Input((16, 16, 3))
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(inputs)))
        for _ in range(4):
            h = block(h, 16)
        outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
        m = keras.Model(inputs, outputs)
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
y = rng.integers(0, 10, size=len(x)).astype("int32")
model = trainer.build(build)

def epoch(setting):
    os.environ["STRATKIT_REPLICA_CHECK"] = setting
    start = time.perf_counter()
    trainer.fit(model, (x, y), epochs=1, global_batch_size=batch, verbose=0)
    return time.perf_counter() - start

epoch("error"); epoch("off")        # warm-up: tracing
on, off = [], []
for i in range(rounds):
    for setting in (("error", "off") if i % 2 == 0 else ("off", "error")):
        (on if setting == "error" else off).append(epoch(setting))
os.environ["STRATKIT_REPLICA_CHECK"] = "error"
replica_check.check(model, trainer.strategy)      # warm-up: the fingerprint step's trace
calls = []
for _ in range(10):
    start = time.perf_counter()
    replica_check.check(model, trainer.strategy)
    calls.append(time.perf_counter() - start)
variables = replica_check._variables(model)
print("RESULT " + json.dumps({"on": on, "off": off, "check_s": statistics.median(calls),
                              "variables": len(variables), "parameters": int(model.count_params())}))
"""


def _run(kind: str, model: str, rounds: int, steps: int) -> dict:
    argv = [sys.executable, "-c", CHILD, kind, model, str(rounds), str(steps)]
    env = clean_env(PYTHONPATH=str(REPO))
    if kind == "mirrored":
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)]
    else:
        cluster = {"worker": [f"127.0.0.1:{p}" for p in loopback_ports(2)]}
        procs = [subprocess.Popen(argv, env={**env, "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}})}, stdout=subprocess.PIPE, text=True)
            for i in range(2)]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{kind}/{model} failed: {[p.returncode for p in procs]}")
    return json.loads(next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))[7:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rounds, steps = (1, 4) if args.quick else (args.rounds, 60)
    rows = []
    for kind in ("mirrored", "two_workers"):
        for model in ("mlp", "resnet"):
            load_before = os.getloadavg()[0]
            got = _run(kind, model, rounds, steps)
            ratios = [a / b for a, b in zip(got["on"], got["off"])]
            rows.append({"strategy": kind, "model": model, "variables": got["variables"],
                         "parameters": got["parameters"], "epoch_s_off": statistics.median(got["off"]),
                         "check_ms": 1000 * got["check_s"],
                         "check_share": got["check_s"] / statistics.median(got["off"]),
                         "ratio_mean": statistics.mean(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(ratios),
                         "load_before": round(load_before, 1), "load_after": round(os.getloadavg()[0], 1)})
    print_table("replica check: epoch time with the check / without (alternating rounds)", rows)
    write_result("replica_check-quick" if args.quick else "replica_check",
                 {"quick": args.quick, "rows": rows, "steps_per_epoch": steps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
