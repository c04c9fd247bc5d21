"""A distributed search in MLflow, on a real `mlflow server`: one parent run, one child per trial, nothing twice.

`stratkit launch --tune --workers 2 --max-restarts 1` runs tests/engine_searches.py's seeded RandomSearch (8
trials, 2 epochs) with `tracking="mlflow"`, through everything that could log a thing twice: tuner 1 SIGKILLs
itself mid-trial (its trial runs again on tuner 0, from its backup), trial 3 fails (KerasTuner's
FailedTrialError), and tuner 0 - the host of the search service and of its MLflow logging - SIGKILLs itself in
its third trial, so the launcher restarts the search, which resumes from its store. Then the server holds one
parent run (FINISHED), one child per trial with its hyperparameters, each epoch's metrics once, and the right
status: FINISHED, or FAILED with the error.
"""

from __future__ import annotations

import subprocess
import sys

import mlflow_server
import pytest
from procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.multiworker, mlflow_server.needs_mlflow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = mlflow_server.start(tmp_path_factory.mktemp("mlflow-server"))
    yield started
    mlflow_server.stop(started)


def test_a_search_retried_and_resumed_is_one_parent_and_one_child_per_trial_each_logged_once(server, tmp_path):
    import mlflow

    env = child_env(None, {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": "search",
                           **mlflow_server.CLIENT_ENV, "STRATKIT_TUNE_LEASE_SECONDS": "6",
                           "SEARCH_FAIL_TRIAL": "3", "SEARCH_KILL_1": f"1:1:{tmp_path / 'killed-1'}",
                           "SEARCH_KILL_0": f"3:1:{tmp_path / 'killed-0'}"})
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--max-restarts", "1",
            "--", sys.executable, str(REPO_ROOT / "tests" / "engine_searches.py"), str(tmp_path), "random",
            "--tracking", "mlflow"]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    assert (tmp_path / "killed-1").exists() and (tmp_path / "killed-0").exists(), done.stdout[-4000:]

    client = mlflow.MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("search").experiment_id
    every = client.search_runs([experiment], max_results=1000)
    parents = [r for r in every if "stratkit.search" in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in every]
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["oracle"] == "RandomSearchOracle"
    children = [r for r in every if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(every) == 1 + len(children)
    trials = sorted(r.data.tags["stratkit.trial"] for r in children)
    assert len(trials) == 8 and len(set(trials)) == 8, trials
    for run in children:
        trial = run.data.tags["stratkit.trial"]
        assert {"units", "lr"} <= set(run.data.params), run.data.params
        if trial == "3":
            assert run.info.status == "FAILED" and "fails on purpose" in run.data.tags["stratkit.error"]
            continue
        assert run.info.status == "FINISHED", (trial, run.info.status, run.data.tags)
        assert run.data.tags["stratkit.trial_status"] == "finished"
        for key in ("loss", "val_loss"):
            steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert sorted(steps) == [0, 1], (trial, key, steps)  # each epoch once, after a retry or a resume too
        assert "score" in run.data.metrics
    retried = {(tmp_path / name).read_text().split()[0] for name in ("killed-1", "killed-0")}
    assert retried <= set(trials)


def test_an_optuna_study_with_a_lost_worker_is_one_parent_and_one_child_per_trial(server, tmp_path):
    """An Optuna study (tests/tuning/optuna_script.py: seeded RandomSampler, MedianPruner, 8 trials of 3 reported
    steps) on 2 workers under `stratkit launch --tune`, tracked in MLflow: worker 1 is SIGKILLed in its first trial
    (the trial fails as lost, a retry with its parameters runs on worker 0) and trial 5's objective raises
    (`catch`: the study goes on). The server then holds one parent (the study) and one child per Optuna trial:
    its parameters, each reported step once (metric `intermediate_value`), its value as `score`, and the state
    Optuna gave it - FINISHED, KILLED (pruned) or FAILED with the objective's error or why its worker was lost."""
    import json
    import os
    import signal

    import mlflow
    from test_keras_tuner import Run

    script = REPO_ROOT / "tests" / "tuning" / "optuna_script.py"
    env = {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": "optuna", **mlflow_server.CLIENT_ENV,
           "STRATKIT_TUNE_LEASE_SECONDS": "3"}
    run = Run([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--", sys.executable,
               str(script), "--tracking", "mlflow", "--hold", "1:0", "--fail-number", "5"], tmp_path, env)
    _, hold = run.wait_for(r"HOLD (\d+) TUNER 1 PID (\d+)", timeout=300)
    lost = int(hold[1])
    os.kill(int(hold[2]), signal.SIGKILL)
    assert run.finish(timeout=900) == 0, run.text[-8000:]
    trials = {t["number"]: t for t in run.results()["0"]["trials"]}
    assert trials[lost]["state"] == "FAIL" and trials[5]["state"] == "FAIL"

    client = mlflow.MlflowClient(server.uri)
    every = client.search_runs([client.get_experiment_by_name("optuna").experiment_id], max_results=1000)
    parents = [r for r in every if "stratkit.search" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [r.info.run_name for r in every]
    assert parents[0].data.params["sampler"] == "RandomSampler" and parents[0].data.params["n_trials"] == "8"
    children = {int(r.data.tags["stratkit.trial"]): r for r in every
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert sorted(children) == sorted(trials) and len(every) == 1 + len(children)
    expected = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
    for number, trial in trials.items():
        child = children[number]
        assert child.info.status == expected[trial["state"]], (number, trial, child.info.status)
        assert {k: json.loads(v) for k, v in child.data.params.items()} == trial["params"], (number, child.data.params)
        history = client.get_metric_history(child.info.run_id, "intermediate_value")
        assert sorted((m.step, m.value) for m in history) == sorted((int(k), v) for k, v in
                                                                    trial["intermediate"].items()), number
        if trial["state"] == "COMPLETE":
            assert child.data.metrics["score"] == trial["value"]
    assert "its tuner was lost" in children[lost].data.tags["stratkit.error"]
    assert "trial 5 fails on purpose" in children[5].data.tags["stratkit.error"]
