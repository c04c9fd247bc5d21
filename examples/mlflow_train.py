"""One MLflow run for a whole cluster: the chief logs, a restarted run continues the same run.

    export MLFLOW_TRACKING_URI=http://127.0.0.1:5000       # your tracking server (default: ./mlflow.db)
    python examples/mlflow_train.py                                    # one process
    stratkit launch --workers 2 --max-restarts 3 -- python examples/mlflow_train.py
    srun -N2 --ntasks-per-node=1 python examples/mlflow_train.py      # a Slurm step

Each of them leaves one run with the params, each epoch's metrics once and the model.
"""

import sys

import keras
import numpy as np

import stratkit
from stratkit.callbacks import MLflowLogger


def train(backup_dir="backup", epochs=3, experiment="stratkit-example", backup_every=None, callbacks=()):
    trainer = stratkit.Trainer()  # first: the strategy this process's place in the cluster calls for
    keras.utils.set_random_seed(0)

    def build_and_compile():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    model = trainer.build(build_and_compile)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
    logger = MLflowLogger(experiment_name=experiment)  # on every worker; only the chief logs
    trainer.fit(model, (x, y), epochs=epochs, global_batch_size=16, backup_dir=backup_dir, backup_every=backup_every,
                callbacks=[logger, *callbacks])
    return logger.run_id  # the run (on the chief; None on the other workers)


if __name__ == "__main__":
    print("MLflow run:", train(*sys.argv[1:2]))
