"""A search whose store is a relative path, on a real local Ray with 2 workers (`RayRunner(tune=True)`).

Each Ray actor runs its tuner in a working directory of its own, so a relative path named in the script
(KerasTuner's `directory="tuning"`, the default store under it, or Optuna's `store="study"`) named a different
directory on each tuner, and the search stopped before its first trial ("tuner 0 keeps the search in
'/tmp/stratkit-ray-task-.../tuning/...', the search service in '/tmp/stratkit-ray-task-...'"). A relative path is
now the driver's: the store is made where the script was started, as under `stratkit launch --tune`.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from ray_helpers import local_ray, needs_ray
from stratkit.ray.runner import RayRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.ray, needs_ray]


@pytest.fixture(scope="module")
def ray_session():
    import cloudpickle

    with local_ray(num_cpus=2) as ray:
        import ray.cloudpickle

        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.register_pickle_by_value(sys.modules[__name__])
        yield ray
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.unregister_pickle_by_value(sys.modules[__name__])


def optuna_search(trials: int) -> dict:
    import optuna

    import stratkit

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = stratkit.tune(optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)), store="study")
    study.optimize(lambda trial: (trial.suggest_float("x", -1, 1) - 0.5) ** 2, n_trials=trials)
    return {"cwd": os.getcwd(), "states": [t.state.name for t in study.trials]}


def keras_tuner_search() -> dict:
    import keras
    import keras_tuner
    import numpy as np

    import stratkit

    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(hp.Int("units", 2, 8), activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    tuner = stratkit.tune(keras_tuner.RandomSearch(build, objective="val_loss", max_trials=2, seed=1,
                                                   directory="tuning", project_name="relative"))
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    tuner.search(x, x.sum(axis=1, keepdims=True), epochs=1, validation_data=(x, x.sum(axis=1, keepdims=True)),
                 verbose=0)
    return {"cwd": os.getcwd(), "trials": sorted(t.status for t in tuner.oracle.trials.values())}


def test_an_optuna_store_named_relative_is_the_drivers_directory(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = RayRunner(num_workers=2, tune=True, timeout=600)
    result = runner.run(optuna_search, 6)
    assert result["cwd"] != str(tmp_path)  # the tuner ran in its actor's own directory
    assert result["states"] == ["COMPLETE"] * 6
    state = json.loads((tmp_path / "study" / "search.json").read_text())
    assert len(state["planner"]["trials"]) == 6
    assert runner.last_run.lost == [] and set(runner.last_run.exit_codes.values()) == {0}


def test_a_keras_tuner_directory_named_relative_is_the_drivers_directory(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = RayRunner(num_workers=2, tune=True, timeout=600)
    result = runner.run(keras_tuner_search)
    assert result["cwd"] != str(tmp_path)
    assert result["trials"] == ["COMPLETED", "COMPLETED"]
    assert (tmp_path / "tuning" / "relative" / "stratkit" / "search.json").exists()
