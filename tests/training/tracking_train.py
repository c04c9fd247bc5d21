"""What the MLflow tests train: examples/mlflow_train.py on 2 workers, and on the first attempt a kill.

Run as a script, it is what `stratkit launch` starts, its arguments one JSON object.

The kills: SIGKILL to the chief at the end of epoch `kills[attempt]` of that attempt
(`STRATKIT_RESTART_COUNT`), *after* the logger logged that epoch (the killer comes
after it in `callbacks`) and before any later backup: the restart then re-trains that
epoch, whose metrics must not be logged twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlflow_train.py"


def train(backup_dir: str, experiment: str, epochs: int, kills: dict[str, int] | None = None,
          backup_every: int | None = None, autolog: bool = False) -> dict:
    if autolog:  # before the strategy, as scripts usually do
        import mlflow

        mlflow.keras.autolog()
        mlflow.tensorflow.autolog()
    import keras

    import stratkit

    spec = importlib.util.spec_from_file_location("mlflow_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    chief = stratkit.detect().is_chief

    seen = {}

    class KillAfterLogging(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # stratkit's guard on model.fit is around this fit although autolog() wrapped fit before the strategy
            from stratkit.strategy.keras_compat import fit_guards

            seen["guarded"] = bool(getattr(fit_guards._inside_guarded_call, "active", False))

        def on_epoch_end(self, epoch, logs=None):
            if chief and (kills or {}).get(os.environ.get("STRATKIT_RESTART_COUNT", "0")) == epoch:
                marker = os.path.exists(os.path.join(backup_dir, "mlflow-run.json"))
                print(f"killing the chief after epoch {epoch} (run marker: {marker})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    run_id = example.train(backup_dir, epochs, experiment, backup_every, callbacks=[KillAfterLogging()])
    return {"run_id": run_id, "chief": chief, **seen}


if __name__ == "__main__":
    print("RESULT " + json.dumps(train(**json.loads(sys.argv[1]))), flush=True)
    os._exit(0)  # without TensorFlow's teardown (seconds on a loaded machine): nothing is left to save
