"""The guard on the user's own `model.fit` holds when another library wrapped `keras.Model.fit` first.

MLflow's `mlflow.keras.autolog()` / `mlflow.tensorflow.autolog()` set `keras.Model.fit`
to a wrapper that calls the `fit` it found when autolog() ran. Called before
`make_strategy()`, that was Keras's own, unguarded `fit`: every `model.fit` then skipped
stratkit's checks and multi-worker fixes (the gradient math, the chief-only files, the
end-of-fit barrier). Observable here through one of the checks: `steps_per_execution > 1`
with two replicas is refused. One real process, a real MLflow: autolog() before the strategy,
then again after it (MLflow then re-wraps the guarded fit); MLflow's switch that turns autologging
off (as `stratkit.callbacks.MLflowLogger` throws it) keeps the wrapper, which calls the fit it holds.
"""

from __future__ import annotations

import textwrap

import mlflow_server
import pytest
from procs import describe, run_process

pytestmark = [pytest.mark.slow, mlflow_server.needs_mlflow]

SCRIPT = textwrap.dedent('''
    import json
    import mlflow
    from mlflow.utils.autologging_utils import disable_autologging
    disable_autologging().__enter__()   # nothing logged (what MLflowLogger does); the wrapper still calls its fit
    mlflow.keras.autolog(log_models=False, log_datasets=False)   # before the strategy: wraps Keras's own fit
    import stratkit
    strategy = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
    import keras
    import numpy as np
    x = np.ones((32, 4), "float32")
    y = np.ones((32, 1), "float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)

    def outcome():
        try:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            return "ran"
        except stratkit.ConfigError as exc:
            return "ConfigError: " + str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc)[:200]}"

    first = outcome()
    mlflow.keras.autolog(log_models=False, log_datasets=False)   # after it: MLflow wraps the guarded fit
    print(json.dumps({"autolog_first": first, "strategy_first": outcome()}))
''')


def test_the_users_fit_is_guarded_whether_mlflow_autolog_came_before_the_strategy_or_after(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    result = run_process(script, timeout=180,
                         env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                              "MLFLOW_DISABLE_TELEMETRY": "true", "STRATKIT_KERAS_COMPAT": None})
    assert result.ok, describe([result])
    report = result.last_json()
    for order, outcome in report.items():
        assert outcome.startswith("ConfigError: steps_per_execution=2"), f"{order}: {outcome}"
