"""An Optuna study for the tests: one process, or one worker of N under `stratkit launch --tune`.

Each trial prints `TRIAL <number> TUNER <tuner> PID <pid> ATTEMPT <attempt>` as its objective starts (the
tests kill workers by these lines), and the script ends with one `RESULT {...}` line: the study's trials
(number, state, params, value, intermediate values, the original of a retry, why a trial was lost).

The objective is plain Python (a few steps of 0.1 s, reported for pruning), or with --keras a small Keras
model trained per trial with optuna-integration's KerasPruningCallback (Keras 3).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import optuna

import stratkit

parser = argparse.ArgumentParser()
parser.add_argument("--trials", type=int, default=8)
parser.add_argument("--store", default=None)
parser.add_argument("--keras", action="store_true")
parser.add_argument("--sampler", choices=("random", "tpe", "grid"), default="random")
parser.add_argument("--pruner", choices=("median", "hyperband"), default="median")
parser.add_argument("--step-seconds", type=float, default=0.1)
parser.add_argument("--hold", action="append", default=[], metavar="TUNER:K",
                    help="in the first attempt, tuner TUNER's K-th trial (0-based) waits to be killed")
parser.add_argument("--hold-retry", type=int, default=None, metavar="TUNER",
                    help="in the first attempt, tuner TUNER's first retried trial waits to be killed")
parser.add_argument("--fail-first", action="store_true", help="the objective raises on its first call")
parser.add_argument("--fail-number", type=int, default=None,
                    help="the objective raises ValueError in the trial of this number (optimize catches it)")
parser.add_argument("--tracking", choices=("auto", "mlflow", "off"), default="auto")
args = parser.parse_args()

optuna.logging.set_verbosity(optuna.logging.WARNING)
TUNER = os.environ.get("STRATKIT_TUNE_TUNER", "-")
ATTEMPT = os.environ.get("STRATKIT_RESTART_COUNT", "0")
HOLD = {tuple(int(p) for p in h.split(":")) for h in args.hold}
STARTED: list[int] = []


def announce(trial: optuna.Trial) -> None:
    retry_of = trial.study.trials[trial.number].system_attrs.get("failed_trial")
    print(f"TRIAL {trial.number} TUNER {TUNER} PID {os.getpid()} ATTEMPT {ATTEMPT} RETRY_OF {retry_of}", flush=True)
    held = (int(TUNER), len(STARTED)) in HOLD or (retry_of is not None and str(args.hold_retry) == TUNER)
    if ATTEMPT == "0" and TUNER != "-" and held:
        print(f"HOLD {trial.number} TUNER {TUNER} PID {os.getpid()}", flush=True)
        while True:
            time.sleep(1)
    STARTED.append(trial.number)
    if args.fail_first and len(STARTED) == 1:
        raise ValueError(f"no model with x={trial.params.get('x')}")


def plain(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -10, 10)
    n = trial.suggest_int("n", 1, 5)
    announce(trial)
    for step in range(3):
        time.sleep(args.step_seconds)
        trial.report((x - 2) ** 2 + n + 1.0 / (step + 1), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    if trial.number == args.fail_number:
        raise ValueError(f"trial {trial.number} fails on purpose")
    return (x - 2) ** 2 + n


def with_keras(trial: optuna.Trial) -> float:
    import keras
    import numpy as np
    from optuna_integration import KerasPruningCallback

    units = trial.suggest_int("units", 2, 16)
    lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
    announce(trial)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype="float32")).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=3, validation_data=(x, y), verbose=0, shuffle=False,
                        callbacks=[KerasPruningCallback(trial, "val_loss")])
    return float(history.history["val_loss"][-1])


samplers = {"random": lambda: optuna.samplers.RandomSampler(seed=1), "tpe": lambda: optuna.samplers.TPESampler(seed=1),
            "grid": lambda: optuna.samplers.GridSampler({"x": [-1.0, 0.0, 2.0, 3.0], "n": [1, 2]})}
pruners = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2),
           "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=3, reduction_factor=2)}
study = optuna.create_study(study_name="test-study", sampler=samplers[args.sampler](), pruner=pruners[args.pruner]())
study = stratkit.tune(study, tracking=args.tracking, **({"store": args.store} if args.store else {}))
started = time.monotonic()
study.optimize(with_keras if args.keras else plain, n_trials=args.trials,
               catch=(ValueError,) if args.fail_number is not None else ())
trials = [{"number": t.number, "state": t.state.name, "params": t.params, "value": t.value,
           "intermediate": {str(k): v for k, v in t.intermediate_values.items()},
           "retry_of": t.system_attrs.get("failed_trial"), "lost": t.system_attrs.get("stratkit_lost")}
          for t in study.trials]
print("RESULT " + json.dumps({"tuner": TUNER, "attempt": ATTEMPT, "seconds": time.monotonic() - started,
                              "trials": trials, "best": study.best_params}), flush=True)
