"""A search's MLflow calls survive the death of the process that hosts it (a real `mlflow server`).

The search service stores its state before it replies to a tuner, so a tuner
told "your epoch's metrics were taken" trusts the store, not the host's queue
of MLflow calls. Here the host's tracking server takes connections and never
answers (its calls wait in the queue, as they do when the host is SIGKILLed a
moment after a report), the state is read as the service would store it, and
a new `SearchTracking` made from that state - as a resumed search makes it -
must log every one of those calls to the real server, each once.
"""

from __future__ import annotations

import socket

import mlflow_server
import pytest

from stratkit.tuning.tracking import SearchTracking, TrackingOptions

pytestmark = [pytest.mark.timeout(300), mlflow_server.needs_mlflow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = mlflow_server.start(tmp_path_factory.mktemp("mlflow-server"))
    yield started
    mlflow_server.stop(started)


@pytest.fixture
def black_hole():
    """A loopback port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_calls_queued_when_the_host_died_are_made_by_the_resumed_search_once(server, black_hole, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "journal")
    dying = SearchTracking(TrackingOptions(tracking_uri=black_hole, experiment_name="journal"), key="store-a")
    dying.trial_started("0", 1, {"units": 8, "lr": 0.01})
    dying.trial_metrics("0", 0, {"loss": 1.5, "val_loss": 1.7})
    dying.trial_started("1", 1, {"units": 16, "lr": 0.1})
    dying.trial_metrics("1", 0, {"loss": 2.5, "val_loss": 2.7})
    dying.trial_metrics("0", 1, {"loss": 1.25, "val_loss": 1.5})
    dying.trial_ended("0", ("finished", None, 1.5))
    stored = dying.state()  # what the service wrote to the store before its replies; then the host died
    assert len(stored["pending"]) == 6, stored

    client = mlflow.MlflowClient(server.uri)
    experiment = client.create_experiment("journal")
    resumed = SearchTracking(TrackingOptions(tracking_uri=server.uri, experiment_id=experiment), key="store-a",
                             state=stored)
    resumed.trial_metrics("1", 1, {"loss": 2.25, "val_loss": 2.5})  # the resumed search goes on
    resumed.trial_metrics("0", 1, {"loss": 9.0})  # a repeat of a logged (metric, step): skipped
    resumed.trial_ended("1", ("failed", "fails on purpose", None))
    resumed.search_ended(None)
    assert resumed.close(timeout=120)
    assert resumed.state()["pending"] == []

    every = client.search_runs([experiment], max_results=100)
    parents = [r for r in every if "stratkit.search" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.data.tags["stratkit.trial"]: r for r in every if r is not parents[0]}
    assert sorted(children) == ["0", "1"] and len(every) == 3
    assert children["0"].data.params == {"units": "8", "lr": "0.01"}
    assert children["1"].data.params == {"units": "16", "lr": "0.1"}
    assert children["0"].info.status == "FINISHED" and children["1"].info.status == "FAILED"
    for trial, losses in (("0", [1.5, 1.25]), ("1", [2.5, 2.25])):
        history = client.get_metric_history(children[trial].info.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == list(enumerate(losses)), (trial, history)
        assert sorted(m.step for m in client.get_metric_history(children[trial].info.run_id, "val_loss")) == [0, 1]


def test_a_directory_mlflow_refuses_as_its_store_is_a_config_error_before_any_trial(tmp_path, monkeypatch):
    import optuna

    import stratkit
    from stratkit import ConfigError

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    ran = []
    study = stratkit.tune(optuna.create_study(), tracking="mlflow")
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI.*Fix: a database, e.g. MLFLOW_TRACKING_URI=sqlite"):
        study.optimize(lambda trial: ran.append(trial.suggest_float("x", 0, 1)) or 0.0, n_trials=2)
    assert ran == []


def test_an_experiment_id_the_server_lacks_is_a_config_error_before_any_trial(server):
    """MLFLOW_EXPERIMENT_ID of another server (here: left in the environment by a notebook's `set_experiment`) made
    every MLflow call of the search fail while its trials ran: nothing was logged, with a warning. Now `options`
    refuses it, naming the variable; with MLFLOW_EXPERIMENT_NAME as well, the two must name one experiment."""
    import mlflow

    from stratkit.errors import ConfigError
    from stratkit.tuning.tracking import options

    client = mlflow.MlflowClient(server.uri)
    first, second = (client.create_experiment(f"journal-{name}") for name in ("first", "second"))
    env = {"MLFLOW_TRACKING_URI": server.uri}
    with pytest.raises(ConfigError) as caught:
        options("mlflow", environ={**env, "MLFLOW_EXPERIMENT_ID": "424242"})
    assert "MLFLOW_EXPERIMENT_ID='424242'" in str(caught.value) and "Fix:" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        options("mlflow", environ={**env, "MLFLOW_EXPERIMENT_ID": first, "MLFLOW_EXPERIMENT_NAME": "journal-second"})
    assert "MLFLOW_EXPERIMENT_NAME='journal-second'" in str(caught.value)
    chosen = options("mlflow", environ={**env, "MLFLOW_EXPERIMENT_ID": second,
                                        "MLFLOW_EXPERIMENT_NAME": "journal-second"})
    assert chosen.experiment_id == second and chosen.tracking_uri == server.uri
