"""The driver's MLflow run, handed to the training tasks: the environment every runner gives them.

A notebook or a Spark/Ray driver often owns the run (`with mlflow.start_run():
runner.run(train_fn)`); the chief task must log into that run, not start its
own. The tasks are fresh processes, on this machine or on executors, so the run
travels in their environment:

| variable | what |
|---|---|
| `STRATKIT_MLFLOW_RUN_ID` | the driver's active run (or the `run_id` passed); `stratkit.callbacks.MLflowLogger` on the chief logs into it |
| `MLFLOW_TRACKING_URI` | where that run lives: the driver's tracking URI, a relative file or SQLite path made absolute |
| `MLFLOW_EXPERIMENT_ID` | its experiment |

`hand_over()` is the driver's side (`LocalRunner`, `SparkRunner` and `RayRunner`
call it; any other runner can merge its result into each task's environment);
`handed_run_id()` the task's. Nothing secret travels: a server's credentials
(`MLFLOW_TRACKING_TOKEN`, `MLFLOW_TRACKING_USERNAME`/`PASSWORD`) stay where they
are set: local tasks inherit them, executors need their own.

Pure Python: imports MLflow only when the driver already did (no MLflow, no run to hand over), never TensorFlow.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

#: The run the chief logs into, set by the runner that started the task.
RUN_ID_VAR = "STRATKIT_MLFLOW_RUN_ID"
#: MLflow's own variables, which the tasks' MLflow reads as usual.
TRACKING_URI_VAR = "MLFLOW_TRACKING_URI"
EXPERIMENT_ID_VAR = "MLFLOW_EXPERIMENT_ID"


def hand_over(environ: Mapping[str, str] | None = None, run_id: str | None = None) -> dict[str, str]:
    """The environment that hands this process's MLflow run to training tasks; merge it into each task's.

    The run is `run_id`, else this process's active run (`mlflow.active_run()`).
    With a run: its id, the tracking URI it lives at and its experiment. Without
    one: only a tracking URI set in `environ` (made absolute), so tasks on other
    machines log to the same store. `{}` when there is nothing to hand over.

    Args:
        environ: the driver's environment (default `os.environ`).
        run_id: hand over this run instead of the active one.
    """
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    uri = environ.get(TRACKING_URI_VAR, "").strip()
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and (run_id is not None or _active(mlflow) is not None):
        run_id = run_id or _active(mlflow).info.run_id
        uri = mlflow.get_tracking_uri()
        experiment = _experiment_of(mlflow, run_id)
        if experiment:
            env[EXPERIMENT_ID_VAR] = experiment
        env[RUN_ID_VAR] = run_id
    elif run_id is not None:
        env[RUN_ID_VAR] = run_id
    if uri:
        env[TRACKING_URI_VAR] = absolute_uri(uri)
    return env


def handed_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """In a task: the run its runner handed over (`STRATKIT_MLFLOW_RUN_ID`), or None."""
    value = (os.environ if environ is None else environ).get(RUN_ID_VAR, "").strip()
    return value or None


def handed_experiment(environ: Mapping[str, str]) -> str | None:
    """The experiment id in `environ` (`MLFLOW_EXPERIMENT_ID`: handed over with a run, or set by the user), or None."""
    value = environ.get(EXPERIMENT_ID_VAR, "").strip()
    return value or None


def absolute_uri(uri: str, cwd: str | None = None) -> str:
    """`uri` with a relative file or SQLite path made absolute (tasks may run in another directory).

    "sqlite:///mlflow.db" -> "sqlite:////work/mlflow.db", "mlruns" -> "file:///work/mlruns";
    a server's URI ("http://...", "databricks") is returned as it is.
    """
    cwd = os.getcwd() if cwd is None else cwd
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = uri[len("sqlite:///"):]
        return "sqlite:///" + os.path.normpath(os.path.join(cwd, path)) if path and path != ":memory:" else uri
    scheme = urlsplit(uri).scheme
    if scheme == "file" and not uri.startswith("file:/"):
        return "file://" + os.path.normpath(os.path.join(cwd, uri[len("file:"):]))
    if not scheme:
        return "file://" + os.path.normpath(os.path.join(cwd, uri))
    return uri


def loopback_server(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """`(host, port)` of the MLflow server `environ`'s tracking URI names on this machine's loopback, or None.

    What a private, loopback-only task network (`stratkit launch`'s) must forward for
    the tasks to reach it (`stratkit.launch.forward`).
    """
    uri = environ.get(TRACKING_URI_VAR, "").strip()
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return ("127.0.0.1" if host == "localhost" else host), port


def _active(mlflow) -> object | None:
    try:
        return mlflow.active_run()
    except Exception:  # noqa: BLE001 - an MLflow without fluent state: nothing active
        return None


def _experiment_of(mlflow, run_id: str) -> str | None:
    active = _active(mlflow)
    if active is not None and active.info.run_id == run_id:
        return active.info.experiment_id
    try:
        return mlflow.MlflowClient().get_run(run_id).info.experiment_id
    except Exception:  # noqa: BLE001 - the chief says it clearly if the run cannot be reached
        return None
