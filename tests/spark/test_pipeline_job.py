"""spark_jobs/pipeline_job.py, the example Spark ML job, run as a user runs it: its own process and Spark.

The job fits Pipeline([VectorAssembler, StandardScaler, KerasEstimator]) on the executors, saves it, scores the
table with the fitted pipeline, stops its SparkSession, and in a new SparkSession loads the saved pipeline
and scores the table again: both scorings must agree row by row. With a real `mlflow server` (SQLite) the
whole job is one run: the training's params and epochs from the chief task, the model, both halves' RMSEs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import mlflow_server
import pytest
from mlflow_server import CLIENT_ENV
from spark_helpers import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_the_pipeline_job_fits_saves_and_scores_the_same_in_a_new_session(tmp_path):
    pytest.importorskip("pyspark")
    pytest.importorskip("sklearn")
    import pyarrow.parquet as pq

    server = mlflow_server.start(tmp_path / "mlflow") if importlib.util.find_spec("mlflow") else None
    env = {**os.environ, **CLIENT_ENV, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if server is not None:
        env["MLFLOW_TRACKING_URI"] = server.uri
    # One worker on local[1]: one Python worker per session imports TensorFlow (2 workers are
    # tests/spark/test_spark_ml.py's); the job's flags as a user passes them.
    try:
        done = subprocess.run([sys.executable, str(REPO_ROOT / "spark_jobs" / "pipeline_job.py"), "--out",
                               str(tmp_path / "out"), "--master", "local[1]", "--workers", "1", "--epochs", "3"],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        runs = _runs(server.uri) if server is not None else None
    finally:
        if server is not None:
            mlflow_server.stop(server)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 442 and summary["workers"] == 1
    assert "[worker:0] Epoch 3/3" in done.stdout
    fitted = dict(zip(*pq.read_table(tmp_path / "out" / "fitted", columns=["id", "prediction"]).to_pydict().values()))
    scored = dict(zip(*pq.read_table(tmp_path / "out" / "scored", columns=["id", "prediction"]).to_pydict().values()))
    assert len(fitted) == len(scored) == 442
    assert max(abs(fitted[i] - scored[i]) for i in fitted) <= 1e-5
    assert abs(summary["rmse"] - summary["fit_rmse"]) <= 1e-4
    if runs is None:
        return
    (run,) = runs                                           # one run for the whole job
    assert run["id"] == (tmp_path / "out" / "mlflow_run").read_text()
    assert run["params"]["epochs"] == "3" and run["params"]["engine"] == "spark"
    assert run["params"]["replicas"] == "1"
    assert run["steps"] == [0, 1, 2]                       # each epoch once, from the chief
    assert abs(run["metrics"]["fit_rmse"] - summary["fit_rmse"]) <= 1e-9
    assert abs(run["metrics"]["score_rmse"] - summary["rmse"]) <= 1e-9    # the score half continued the run
    assert run["model"], "the Keras model was not logged"


def _runs(uri: str) -> list[dict]:
    """Every run on the server: id, params, last metrics, the steps `loss` was logged at, whether a model is logged."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = []
    for run in client.search_runs(experiments):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
        models = client.search_logged_models(experiment_ids=experiments,
                                             filter_string=f"source_run_id = '{run.info.run_id}'")
        runs.append({"id": run.info.run_id, "params": run.data.params, "metrics": run.data.metrics,
                     "steps": steps, "model": bool(models)})
    return runs
