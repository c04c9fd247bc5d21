"""An Optuna study, distributed by one line: `stratkit.tune(...)` around the study.

    python examples/tune_optuna.py                                      # one process
    stratkit launch --tune --workers 2 -- python examples/tune_optuna.py     # 2 workers, worker 0 holds the study
    python examples/tune_optuna.py --local-runner 2                     # 2 workers from this process

`n_trials` is the study's (8 trials in all, however many workers run them). With its seeded sampler the study
tries the same hyperparameters every way, and each trial scores as it would alone; which trials the median
pruner stops depends on which others finished first (docs/tuning.md, "Optuna"). `--store s3://bucket/study`
keeps the study on a store (a restarted chief resumes it there).
"""

import argparse
import json

import keras
import optuna
from optuna_integration import KerasPruningCallback
from sklearn.datasets import load_digits

import stratkit


def objective(trial):
    digits = load_digits()
    x, y = (digits.data / 16).astype("float32"), digits.target
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(trial.suggest_int("units", 16, 128, step=16), activation="relu"),
        keras.layers.Dropout(trial.suggest_float("dropout", 0.0, 0.4)),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x[:1400], y[:1400], epochs=trial.study.user_attrs["epochs"], verbose=0,
                        validation_data=(x[1400:], y[1400:]),
                        callbacks=[KerasPruningCallback(trial, "val_accuracy")])  # reports each epoch, prunes
    return history.history["val_accuracy"][-1]


def search(trials=8, epochs=3, store=None):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    study.set_user_attr("epochs", epochs)
    study = stratkit.tune(study, store=store)                # the one stratkit line
    study.optimize(objective, n_trials=trials)               # the study's trials, on every worker together
    return {"best": study.best_params, "value": study.best_value,     # on every worker: the whole study
            "trials": [[t.number, t.state.name, t.params, t.value, t.intermediate_values] for t in study.trials]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--store", default=None, help="a store URL or directory every worker reaches")
    parser.add_argument("--local-runner", type=int, default=0, metavar="N", help="run N workers with LocalRunner")
    args = parser.parse_args()
    if args.local_runner:
        result = stratkit.LocalRunner(num_workers=args.local_runner, tune=True).run(
            search, args.trials, args.epochs, args.store)
    else:
        result = search(args.trials, args.epochs, args.store)
    print(json.dumps(result, sort_keys=True), flush=True)
