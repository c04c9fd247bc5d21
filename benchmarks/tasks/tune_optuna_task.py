"""One worker of the tuning benchmark's Optuna study (benchmarks/bench_tuning.py --library optuna): the example's
digits study (examples/tune_optuna.py's objective, its seeded TPE) without pruning (each way then trains every
trial fully), plain Optuna (`--plain`) or through `stratkit.tune`; prints one `TUNE {...}` line: this worker's
study wall time, the seconds its objective ran (the trials' own training, timed around the call), and the
values of the study's trials."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import tune_optuna as example  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true")
parser.add_argument("--trials", type=int, default=8)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

own: list[float] = []


def timed(trial: optuna.Trial) -> float:
    started = time.perf_counter()
    try:
        return example.objective(trial)
    finally:
        own.append(time.perf_counter() - started)


optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0),
                            pruner=optuna.pruners.NopPruner())
study.set_user_attr("epochs", args.epochs)
if not args.plain:
    import stratkit

    study = stratkit.tune(study)
started = time.perf_counter()
study.optimize(timed, n_trials=args.trials)
wall = time.perf_counter() - started
print("TUNE " + json.dumps({"wall": wall, "own": sum(own), "trials": len(own),
                            "scores": {str(t.number): t.value for t in study.trials}}), flush=True)
