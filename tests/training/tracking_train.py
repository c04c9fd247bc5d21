"""What the MLflow tests train: a tiny model on 2 workers, `MLflowLogger`, and on the first attempt a kill.

`train(...)` is the training function (`LocalRunner.run(train, ...)` pickles it by
reference: tests/ is on the tasks' PYTHONPATH); run as a script, it is what
`stratkit launch` starts, its arguments one JSON object.

The kill: SIGKILL to the chief at the end of epoch `kill_after_epoch`, on the first
attempt only, *after* the logger logged that epoch (the killer comes after it in
`callbacks`) and before any later backup: the restart then re-trains that epoch,
whose metrics must not be logged twice.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def train(backup_dir: str, experiment: str, epochs: int, kill_after_epoch: int | None = None,
          backup_every: int | None = None, autolog: bool = False) -> dict:
    if autolog:  # before the strategy, as scripts usually do
        import mlflow

        mlflow.keras.autolog()
        mlflow.tensorflow.autolog()
    import keras
    import numpy as np

    import stratkit
    from stratkit.callbacks import MLflowLogger

    trainer = stratkit.Trainer()
    keras.utils.set_random_seed(0)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    model = trainer.build(build)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")

    class KillAfterLogging(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == kill_after_epoch and trainer.is_chief and os.environ.get("STRATKIT_RESTART_COUNT") == "0":
                print(f"killing the chief after epoch {epoch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    logger = MLflowLogger(experiment_name=experiment)
    trainer.fit(model, (x, y), epochs=epochs, global_batch_size=16, backup_dir=backup_dir, backup_every=backup_every,
                callbacks=[logger, KillAfterLogging()], verbose=0, shuffle=False)
    return {"run_id": logger.run_id, "chief": trainer.is_chief}


if __name__ == "__main__":
    print("RESULT " + json.dumps(train(**json.loads(sys.argv[1]))), flush=True)
