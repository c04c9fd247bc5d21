"""One MLflow run for the whole cluster, against a real `mlflow server` (SQLite backend) on 127.0.0.1.

`stratkit.callbacks.MLflowLogger` on 2 real workers (examples/mlflow_train.py, which docs/tracking.md
shows, wrapped by tests/training/tracking_train.py): the chief logs, the other worker
logs nothing; a run killed mid-run and restarted by `stratkit launch` continues the same
run, each epoch's metrics once, the model at the end, MLflow's own autologging switched
on in the script changing none of that (nor stratkit's guard on `fit`). The kill comes
right after the chief logged an epoch and before the next backup, so the restart
re-trains part of that epoch. A notebook in a
real Jupyter kernel trains with `LocalRunner` and then `SparkRunner`, each in the
driver's run. One server for the module (`tests/mlflow_server.py`), guarded by the
network rule like the training tasks.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow_server
import pytest
import tracking_train
from procs import child_env

from stratkit.training.tracking import handoff

pytestmark = [pytest.mark.slow, pytest.mark.multiworker, mlflow_server.needs_mlflow]

TRAIN = Path(tracking_train.__file__)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = mlflow_server.start(tmp_path_factory.mktemp("mlflow-server"))
    yield started
    mlflow_server.stop(started)


@pytest.fixture(scope="module")
def client(server):
    import mlflow

    mlflow.set_tracking_uri(server.uri)  # (the model's URI is read through the default client)
    yield mlflow.MlflowClient(server.uri)
    mlflow.set_tracking_uri(None)


def task_env(server) -> dict[str, str]:
    env = child_env(None, {"MLFLOW_TRACKING_URI": server.uri, **mlflow_server.CLIENT_ENV,
                           "STRATKIT_RUNNER": None, "MLFLOW_EXPERIMENT_NAME": None, "MLFLOW_EXPERIMENT_ID": None})
    return env


def runs_of(client, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def steps(client, run) -> dict[str, list[int]]:
    """Each metric of `run` and the steps of its values, in order (a repeated epoch shows twice)."""
    return {key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics}


def models_of(client, run) -> list:
    return list(client.search_logged_models([run.info.experiment_id],
                                            filter_string=f"source_run_id = '{run.info.run_id}'"))


def test_a_killed_and_restarted_launch_with_autologging_on_leaves_one_run_with_every_epoch_once_and_the_model(
        server, client, tmp_path):
    """Killed right after the chief logged epoch 0, past the step backup inside it (the run id is in that backup's
    callbacks' state, and in the marker beside it): the restart re-trains the end of epoch 0, logged already."""
    backup = tmp_path / "backup"
    args = {"backup_dir": str(backup), "experiment": "killed-launch", "epochs": 3, "kills": {"0": 0},
            "backup_every": 3, "autolog": True}  # 4 steps an epoch: the backup before the kill at epoch 0 step 3
    result = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--max-restarts", "1",
                             "--stop-grace", "2", "--", sys.executable, str(TRAIN), json.dumps(args)],
                            env=task_env(server), capture_output=True, text=True, timeout=600, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert "killing the chief after epoch 0 (run marker: True)" in out, out[-5000:]
    assert "is relayed into the private network" in out  # the tasks reached the server from their namespace
    assert "(backup) at http://127.0.0.1" in out, "the restart took the run id from the backup"

    runs = runs_of(client, "killed-launch")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    chief = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]
    assert {r["run_id"] for r in chief if r["chief"]} == {run.info.run_id}
    assert [r["guarded"] for r in chief] == [True, True]  # autolog() before the strategy kept stratkit's guard
    assert client.search_runs(["0"]) == []  # autologging's own runs (one per worker) would be in Default
    assert run.info.status == "FINISHED"
    assert steps(client, run) == {"loss": [0, 1, 2], "mae": [0, 1, 2]}
    params = run.data.params
    assert params["engine"] == "launch" and params["workers"] == "2" and params["replicas"] == "2"
    assert params["strategy"] == "multi_worker_mirrored" and params["global_batch_size"] == "16"
    assert {"stratkit_version", "keras_version", "tensorflow_version"} <= set(params)
    assert not {"batch_size", "optimizer_name"} & set(params)  # autologging logged nothing
    assert run.data.tags["stratkit.resumes"] == "resumed at epoch 0 step 3"
    models = models_of(client, run)
    assert [(m.name, m.status.name) for m in models] == [("model", "READY")]
    assert not client.search_logged_models(["0"])
    import mlflow.models

    signature = mlflow.models.get_model_info(f"models:/{models[0].model_id}").signature
    assert signature is not None and tuple(signature.inputs.inputs[0].shape) == (-1, 4)
    assert not backup.exists()  # finished: the backups and the run's marker are gone


def test_which_run_the_chief_logs_into_first_that_applies(client, tmp_path, monkeypatch):
    from stratkit.training.tracking import runs

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    experiment = client.create_experiment("choices")
    made = [client.create_run(experiment).info.run_id for _ in range(5)]

    def choose(environ=None, **given):
        options = {"explicit": None, "active": None, "restored": None, "marker_dir": None,
                   "experiment_name": "choices", "run_name": None, "tags": {}, **given}
        choice = runs.choose_run(client, environ=environ or {}, **options)
        return choice.how, choice.run_id if choice.how != "new" else None, choice.owned

    assert choose(explicit=made[0], environ={"STRATKIT_MLFLOW_RUN_ID": made[1]}) == ("run_id=", made[0], False)
    assert choose({"STRATKIT_MLFLOW_RUN_ID": made[1]}, active=made[2]) == ("handed over by the runner", made[1], False)
    assert choose({"MLFLOW_RUN_ID": made[1]}, active=made[2]) == ("handed over by the runner", made[1], False)
    assert choose(active=made[2], restored=made[3]) == ("active", made[2], False)
    runs.write_marker(str(tmp_path), made[4])
    assert choose(restored=made[3], marker_dir=str(tmp_path)) == ("backup", made[3], True)
    assert choose(marker_dir=str(tmp_path)) == ("marker", made[4], True)
    client.delete_run(made[4])  # a run this training started, deleted meanwhile: a new one, and the marker names it
    assert choose(marker_dir=str(tmp_path)) == ("new", None, True)
    fresh = runs.read_marker(str(tmp_path))
    assert fresh not in made and client.get_run(fresh).info.experiment_id == experiment
    runs.remove_marker(str(tmp_path))
    assert runs.read_marker(str(tmp_path)) is None and not tmp_path.exists()  # emptied: removed with it


def test_the_driver_hands_its_run_and_an_absolute_tracking_uri_to_the_tasks(server, client, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert handoff.hand_over({}) == {}
    assert handoff.hand_over({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}) == \
        {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    assert handoff.absolute_uri("mlruns", "/w") == "file:///w/mlruns"
    assert handoff.absolute_uri("file:runs", "/w") == "file:///w/runs"
    assert handoff.absolute_uri(server.uri, "/w") == server.uri
    assert handoff.loopback_server({"MLFLOW_TRACKING_URI": "http://localhost:5000"}) == ("127.0.0.1", 5000)
    assert handoff.loopback_server({"MLFLOW_TRACKING_URI": "https://mlflow.example.com"}) is None
    experiment = mlflow.set_experiment("handed")
    with mlflow.start_run() as run:
        env = handoff.hand_over({})
    assert env == {"STRATKIT_MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_TRACKING_URI": server.uri,
                   "MLFLOW_EXPERIMENT_ID": experiment.experiment_id}
    assert handoff.handed_run_id(env) == run.info.run_id


NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "local_to_spark.ipynb"


@pytest.mark.spark
def test_a_notebook_trains_on_two_local_workers_and_the_same_function_on_spark_gives_the_same_weights(
        server, client, tmp_path, monkeypatch):
    """examples/local_to_spark.ipynb in a real Jupyter kernel (nbclient + ipykernel), headless."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("pyspark")
    import numpy as np

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(  # what the test reads; the example itself ends before
        'import json\nprint("RESULT " + json.dumps({"local": local, "spark": on_spark}))'))
    for key, value in {**task_env(server), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}.items():
        monkeypatch.setenv(key, value)  # the kernel's environment (and its tasks')
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ["".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
               for cell in notebook.cells if cell.cell_type == "code"]
    result = json.loads(printed[-1].split("RESULT ", 1)[1])
    assert "same weights within 1e-5: True" in printed[-2], printed[-2]
    local, spark = result["local"], result["spark"]
    assert len(local["loss"]) == 3 and local["loss"][-1] < local["loss"][0]
    np.testing.assert_allclose(local["loss"], spark["loss"], rtol=0, atol=1e-5)
    for a, b in zip(local["weights"], spark["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-5)

    runs = {r.info.run_name: r for r in runs_of(client, "local-then-spark")}
    assert set(runs) == {"2 local workers", "2 Spark tasks"}  # the driver's runs, continued by each chief
    for name, engine in (("2 local workers", "local"), ("2 Spark tasks", "spark")):
        run = runs[name]
        assert run.info.status == "FINISHED" and run.data.params["engine"] == engine
        assert steps(client, run) == {"loss": [0, 1, 2]}
        assert [m.status.name for m in models_of(client, run)] == ["READY"]


def test_a_tracking_server_that_does_not_answer_is_refused_before_training_without_printing_its_password(server):
    """What the chief's MLflowLogger() checks when it is made (TensorFlow-free here: `runs.probe`)."""
    from stratkit.errors import ConfigError
    from stratkit.training.tracking import runs

    runs.probe(server.uri)  # a server that answers passes
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        uri = f"http://someone:pa55word@127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            runs.probe(uri)
    assert time.monotonic() - started < 10  # (MLflow's own client retries for minutes)
    message = str(caught.value)
    assert "MLFLOW_TRACKING_URI" in message and "Fix:" in message and "http://***@127.0.0.1" in message
    assert "pa55word" not in message
