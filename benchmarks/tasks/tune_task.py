"""One tuner of the tuning benchmark's search (benchmarks/bench_tuning.py): the example's digits RandomSearch,
plain KerasTuner (`--plain`) or through `stratkit.tune`; prints one `TUNE {...}` line: this tuner's search wall
time, the seconds spent building and fitting its trials (KerasTuner's `Tuner._build_and_fit_model`, timed
around the call), and the trials it ran."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import keras_tuner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import tune_keras_tuner as example  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true")
parser.add_argument("--trials", type=int, default=8)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

own: list[float] = []
real = keras_tuner.Tuner._build_and_fit_model


def timed(self, trial, *fit_args, **fit_kwargs):
    started = time.perf_counter()
    try:
        return real(self, trial, *fit_args, **fit_kwargs)
    finally:
        own.append(time.perf_counter() - started)


keras_tuner.Tuner._build_and_fit_model = timed
digits = example.load_digits()
x, y = (digits.data / 16).astype("float32"), digits.target
tuner = keras_tuner.RandomSearch(example.build_model, objective="val_accuracy", max_trials=args.trials, seed=1,
                                 directory="tuning", project_name="digits")
if not args.plain:
    import stratkit

    tuner = stratkit.tune(tuner)
started = time.perf_counter()
tuner.search(x[:1400], y[:1400], epochs=args.epochs, validation_data=(x[1400:], y[1400:]), verbose=0)
wall = time.perf_counter() - started
print("TUNE " + json.dumps({"wall": wall, "own": sum(own), "trials": len(own),
                            "scores": {t.trial_id: t.score for t in tuner.oracle.trials.values()}}), flush=True)
