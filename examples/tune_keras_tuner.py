"""A KerasTuner search, distributed by one line: `stratkit.tune(...)` around the tuner.

    python examples/tune_keras_tuner.py                                   # one process
    stratkit launch --tune --workers 2 -- python examples/tune_keras_tuner.py   # 2 tuners, worker 0 the chief
    python examples/tune_keras_tuner.py --local-runner 2                  # 2 tuners from this process

With its seed the search tries the same hyperparameters and gets the same scores every way (docs/tuning.md).
`--store s3://bucket/search` keeps the search's state and trials on a store (no shared disk needed; a restarted
chief resumes there).
"""

import argparse
import json

import keras
import keras_tuner
from sklearn.datasets import load_digits

import stratkit


def build_model(hp):
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(hp.Int("units", 16, 128, step=16), activation="relu"),
        keras.layers.Dropout(hp.Float("dropout", 0.0, 0.4)),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(hp.Float("learning_rate", 1e-4, 1e-2, sampling="log")),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def search(trials=8, epochs=3, store=None):
    digits = load_digits()
    x, y = (digits.data / 16).astype("float32"), digits.target
    tuner = stratkit.tune(keras_tuner.RandomSearch(build_model, objective="val_accuracy", max_trials=trials,
                                                   seed=1, directory="tuning", project_name="digits"),
                          store=store)                       # the one stratkit line
    tuner.search(x[:1400], y[:1400], epochs=epochs, validation_data=(x[1400:], y[1400:]), verbose=0)
    best = tuner.get_best_models()[0]                        # on every tuner, read back from the store
    _, accuracy = best.evaluate(x[1400:], y[1400:], verbose=0)
    return {"best": tuner.get_best_hyperparameters()[0].values, "accuracy": float(accuracy),
            "trials": {t.trial_id: t.score for t in tuner.oracle.trials.values()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--store", default=None, help="a store URL or directory every tuner reaches")
    parser.add_argument("--local-runner", type=int, default=0, metavar="N", help="run N tuners with LocalRunner")
    args = parser.parse_args()
    if args.local_runner:
        result = stratkit.LocalRunner(num_workers=args.local_runner, tune=True).run(
            search, args.trials, args.epochs, args.store)
    else:
        result = search(args.trials, args.epochs, args.store)
    print(json.dumps(result, sort_keys=True), flush=True)
