"""What step backups cost: time per step without a backup, with `backup_dir` (epoch backups), and with
`backup_every=K`, for two model sizes; the write time of one backup; 2 workers with and without `backup_dir`.

One process (one device) per model size runs the three variants side by side in alternating rounds (the
order rotates each round), so machine noise hits all alike: the steady time per step of each (mean, min and
max over the rounds) and every backup's write time (`stratkit.training.checkpoint.store.write_backup`,
timed around the call). Then 2 workers under `stratkit launch` time the collective that carried
preemption notices and timed backups before they went through TensorFlow's coordination service (and still
does where none runs: `stratkit.strategy.collectives.sum_over_workers`, an all-gather of two ints) alone, and
the small model's time per step with and without `backup_dir`, in alternating rounds.
The 1-minute load average is recorded before and after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

MODELS = {"small": [256, 512, 512], "large": [1024, 2048, 2048]}

ONE_PROCESS = r"""
import json, os, sys, tempfile, time
import stratkit
trainer = stratkit.Trainer(strategy="one_device")
import keras, numpy as np
from stratkit.training.checkpoint import store

widths, rounds, steps, every, batch = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 64
writes = []
real = store.write_backup
def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
        return real(*args, **kwargs)
    finally:
        writes.append(time.perf_counter() - start)
store.write_backup = timed

rng = np.random.default_rng(0)
x = rng.normal(size=(steps * batch, widths[0])).astype("float32")
y = rng.integers(0, 10, size=steps * batch).astype("int32")

def build():
    layers = [keras.Input((widths[0],))] + [keras.layers.Dense(w, activation="relu") for w in widths[1:]]
    model = keras.Sequential(layers + [keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

model = trainer.build(build)
params = int(model.count_params())

class StepTimes(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.times.append(time.perf_counter())
    def on_train_begin(self, logs=None):
        self.times = []

def run(variant):
    timer = StepTimes()
    options = {}
    directory = tempfile.mkdtemp(prefix="bench-backups-")
    if variant != "none":
        options["backup_dir"] = os.path.join(directory, "backup")
    if variant.startswith("every"):
        options["backup_every"] = every
    del writes[:]
    trainer.fit(model, (x, y), epochs=2, global_batch_size=batch, callbacks=[timer], verbose=0, **options)
    t = timer.times
    second = t[steps:]  # epoch 2: traced, warm; its K-step backups included (the last boundary's is not)
    per_step = (second[-1] - second[0]) / (len(second) - 1)
    return per_step, list(writes)

variants = ["none", "epoch", f"every {every}"]
trainer.fit(model, (x, y), epochs=1, global_batch_size=batch, verbose=0)  # trace once
out = {v: {"step_s": [], "writes": []} for v in variants}
for r in range(rounds):
    for v in variants[r % 3:] + variants[:r % 3]:
        per_step, w = run(v)
        out[v]["step_s"].append(per_step)
        out[v]["writes"].extend(w)
print(json.dumps({"params": params, "variants": out}))
"""

TWO_WORKERS = r"""
import json, os, sys, tempfile, time
import stratkit
trainer = stratkit.Trainer()
import keras, numpy as np
from stratkit.strategy.collectives import sum_over_workers

rounds, steps, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
batch = 64
rng = np.random.default_rng(0)
x = rng.normal(size=(steps * batch, 256)).astype("float32")
y = rng.integers(0, 10, size=steps * batch).astype("int32")

def build():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

model = trainer.build(build)

class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []
    def on_train_batch_begin(self, batch, logs=None):
        self.times.append(time.perf_counter())

def run(variant):
    timer = StepTimes()
    options = {"backup_dir": os.path.join(sys.argv[4], f"b{time.time_ns()}")} if variant == "backup_dir" else {}
    trainer.fit(model, (x, y), epochs=2, global_batch_size=batch, callbacks=[timer], verbose=0, **options)
    second = timer.times[steps:]
    return (second[-1] - second[0]) / (len(second) - 1)

trainer.fit(model, (x, y), epochs=1, global_batch_size=batch, verbose=0)
sum_over_workers(trainer.strategy, [0, 0])  # traced
agree, plain, with_backup = [], [], []
for r in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
        sum_over_workers(trainer.strategy, [0, 0])
    agree.append((time.perf_counter() - start) / calls)
    for variant in (["none", "backup_dir"] if r % 2 == 0 else ["backup_dir", "none"]):
        (plain if variant == "none" else with_backup).append(run(variant))
if trainer.is_chief:
    print("RESULT " + json.dumps({"agree_s": agree, "none_step_s": plain, "backup_dir_step_s": with_backup}))
"""


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def one_process(widths: list[int], rounds: int, steps: int, every: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS, json.dumps(widths), str(rounds), str(steps),
                          str(every)], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def two_workers(rounds: int, steps: int, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    for name in [n for n in env if n.startswith("STRATKIT_") or n == "TF_CONFIG"]:
        env.pop(name)
    with tempfile.TemporaryDirectory(prefix="bench-backups-") as scratch:
        script = Path(scratch) / "two_workers.py"
        script.write_text(TWO_WORKERS)
        out = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--", sys.executable,
                              str(script), str(rounds), str(steps), str(calls), scratch],
                             capture_output=True, text=True, env=env, timeout=1800)
    lines = [line.split("RESULT ", 1)[1] for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode or not lines:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else max(args.rounds, 3)
    steps, every = (12, 4) if args.quick else (40, 10)
    models = {"small": [16, 32]} if args.quick else MODELS
    rows = []
    for name, widths in models.items():
        load_before = os.getloadavg()[0]
        raw = one_process(widths, rounds, steps, every)
        load_after = os.getloadavg()[0]
        base = _stats(raw["variants"]["none"]["step_s"])["mean"]
        for variant, values in raw["variants"].items():
            step = _stats(values["step_s"])
            write = _stats(values["writes"])
            rows.append({"model": f"{name} ({raw['params']:,} params)", "variant": variant,
                         "step ms": _ms(step["mean"]), "step min ms": _ms(step["min"]),
                         "step max ms": _ms(step["max"]), "vs none": round(step["mean"] / base, 3) if base else None,
                         "writes": len(values["writes"]), "write ms": _ms(write["mean"]),
                         "write min ms": _ms(write["min"]), "write max ms": _ms(write["max"]),
                         "load before": load_before, "load after": load_after})
    print_table(f"time per step and per backup write (one device, {rounds} alternating rounds; epoch 2 of each "
                f"fit, {steps} steps of global batch 64; every: backup_every={every})", rows)
    load_before = os.getloadavg()[0]
    calls = 20 if args.quick else 200
    workers = two_workers(rounds, steps, calls)
    load_after = os.getloadavg()[0]
    agree = _stats(workers["agree_s"])
    plain, backed = _stats(workers["none_step_s"]), _stats(workers["backup_dir_step_s"])
    collective = [{"what": "sum_over_workers([0, 0]) alone", "mean ms": _ms(agree["mean"]),
                   "min ms": _ms(agree["min"]), "max ms": _ms(agree["max"]), "load before": load_before,
                   "load after": load_after},
                  {"what": "small model step, no backup_dir", "mean ms": _ms(plain["mean"]),
                   "min ms": _ms(plain["min"]), "max ms": _ms(plain["max"]), "load before": load_before,
                   "load after": load_after},
                  {"what": "small model step, backup_dir (the per-step agreement)", "mean ms": _ms(backed["mean"]),
                   "min ms": _ms(backed["min"]), "max ms": _ms(backed["max"]), "load before": load_before,
                   "load after": load_after}]
    print_table(f"2 workers (stratkit launch --workers 2, {rounds} rounds, {calls} calls per round)", collective)
    payload = {"quick": args.quick, "rounds": rounds, "steps_per_epoch": steps, "backup_every": every,
               "global_batch": 64, "rows": rows, "two_workers": collective, "raw_two_workers": workers}
    print(f"wrote {write_result('backups' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
