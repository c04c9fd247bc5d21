"""`RayRunner` inside the driver's MLflow run: the chief task continues that run, the other task logs nothing.

A real local Ray (`ray_helpers.local_ray`) and a real `mlflow server` (SQLite) on 127.0.0.1.
"""

from __future__ import annotations

import os
import sys

import mlflow_server
import pytest
from ray_helpers import local_ray, needs_ray

from stratkit.ray.runner import RayRunner

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.multiworker, needs_ray, mlflow_server.needs_mlflow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = mlflow_server.start(tmp_path_factory.mktemp("mlflow-server"))
    yield started
    mlflow_server.stop(started)


@pytest.fixture(scope="module")
def ray_session(server):
    import cloudpickle

    saved = {key: os.environ.get(key) for key in mlflow_server.CLIENT_ENV}
    os.environ.update(mlflow_server.CLIENT_ENV)  # Ray's workers start with it
    try:
        with local_ray() as ray:
            import ray.cloudpickle

            # train travels to the tasks by value: they cannot import this module.
            for pickler in (cloudpickle, ray.cloudpickle):
                pickler.register_pickle_by_value(sys.modules[__name__])
            yield ray
            for pickler in (cloudpickle, ray.cloudpickle):
                pickler.unregister_pickle_by_value(sys.modules[__name__])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train(epochs):
    import keras
    import numpy as np

    import stratkit
    from stratkit.callbacks import MLflowLogger

    trainer = stratkit.Trainer()
    keras.utils.set_random_seed(0)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = trainer.build(build)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    logger = MLflowLogger()
    trainer.fit(model, (x, x.sum(axis=1, keepdims=True)), epochs=epochs, global_batch_size=16, callbacks=[logger],
                verbose=0)
    return logger.run_id


def test_the_chief_task_continues_the_drivers_run(server, ray_session):
    import mlflow

    mlflow.set_tracking_uri(server.uri)
    try:
        mlflow.set_experiment("ray-driver")
        with mlflow.start_run() as run:
            logged_to = RayRunner(num_workers=2, timeout=400).run(train, 2)
        client = mlflow.MlflowClient(server.uri)
        runs = client.search_runs([run.info.experiment_id])
        assert logged_to == run.info.run_id and [r.info.run_id for r in runs] == [run.info.run_id]
        assert client.search_runs(["0"]) == []
        finished = client.get_run(run.info.run_id)
        assert finished.data.params["engine"] == "ray" and finished.data.params["workers"] == "2"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1]
    finally:
        mlflow.set_tracking_uri(None)
