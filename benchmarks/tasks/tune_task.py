"""One tuner of the tuning benchmark's search (benchmarks/bench_tuning.py): the example's digits RandomSearch,
plain KerasTuner (`--plain`) or through `stratkit.tune`; prints one `TUNE {...}` line: this tuner's search wall
time, the seconds spent building and fitting its trials (KerasTuner's `Tuner._build_and_fit_model`, timed
around the call), the part of those that was stratkit's own inside a fit (the trial's `Backup` hooks and the
checkpoint uploads, each timed around the call), and the trials it ran. `report` is the same as a function, for
the engines' tuners (benchmarks/tasks/tune_engines.py ships it to Spark and Ray)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import tune_keras_tuner as example  # noqa: E402


def _timed(cls, name: str, into: list[float]) -> None:
    """Time every call of `cls.name` into `into`."""
    original = getattr(cls, name)

    def run(*call_args, **call_kwargs):
        started = time.perf_counter()
        try:
            return original(*call_args, **call_kwargs)
        finally:
            into.append(time.perf_counter() - started)

    setattr(cls, name, run)


def report(trials: int, epochs: int, plain: bool = False, search: str = "random") -> dict:
    """Run the search as this process's tuner; print and return its `TUNE` report. `search`: "random" (a
    RandomSearch of `trials` trials of `epochs` epochs) or "hyperband" (a Hyperband search with `max_epochs=epochs`,
    factor 3: its brackets decide the trials and their epochs)."""
    import keras_tuner

    own: list[float] = []
    inside: list[float] = []
    _timed(keras_tuner.Tuner, "_build_and_fit_model", own)
    if not plain:
        from stratkit.training.checkpoint.callback import Backup
        from stratkit.tuning.kt_trials import TunerState

        for hook in ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_epoch_end", "on_train_end",
                     "release"):
            _timed(Backup, hook, inside)
        _timed(TunerState, "upload", inside)
    digits = example.load_digits()
    x, y = (digits.data / 16).astype("float32"), digits.target
    if search == "hyperband":
        tuner = keras_tuner.Hyperband(example.build_model, objective="val_accuracy", max_epochs=epochs, factor=3,
                                      seed=1, directory="tuning", project_name="digits")
    else:
        tuner = keras_tuner.RandomSearch(example.build_model, objective="val_accuracy", max_trials=trials, seed=1,
                                         directory="tuning", project_name="digits")
    if not plain:
        import stratkit

        tuner = stratkit.tune(tuner)
    started = time.perf_counter()
    tuner.search(x[:1400], y[:1400], epochs=epochs, validation_data=(x[1400:], y[1400:]), verbose=0)
    wall = time.perf_counter() - started
    out = {"wall": wall, "own": sum(own), "inside": sum(inside), "trials": len(own),
           "scores": {t.trial_id: t.score for t in tuner.oracle.trials.values()}}
    print("TUNE " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--search", choices=("random", "hyperband"), default="random")
    args = parser.parse_args()
    report(args.trials, args.epochs, args.plain, args.search)
