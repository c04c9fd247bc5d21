"""Which MLflow run the chief logs into, and what that run already holds.

The choice, first that applies (`choose_run`):

1. `run_id=` given to the logger;
2. the run the runner handed over (`STRATKIT_MLFLOW_RUN_ID`: the driver's, `handoff.py`), or
   MLflow's own `MLFLOW_RUN_ID` (MLflow Projects);
3. the run active in the chief's process (the user's `mlflow.start_run()`);
4. the run this training started before a restart: kept in the backup with the callbacks' state
   (it travels with the backup, e.g. through a Ray checkpoint), or, for a restart before the first
   complete backup, in the marker file `mlflow-run.json` beside the backups;
5. a new run, whose id the chief puts in the marker at once.

Runs of 4 and 5 are this training's own: the logger ends them (FINISHED) when training ends and
removes the marker. The others belong to whoever made them.

Each epoch is logged once: a run that already exists is read first (`logged_steps`), and an epoch
whose metric is there is not logged again: a restart re-trains the epochs after its backup, and the
crash may have come after the chief logged one of them but before the next backup.

Imports MLflow (the caller has), no TensorFlow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from stratkit import files, status
from stratkit.errors import ConfigError
from stratkit.training.tracking.handoff import EXPERIMENT_ID_VAR, TRACKING_URI_VAR, handed_experiment, handed_run_id

log = status.logger(__name__)

#: The marker file in backup_dir: the run this training started, until it ends.
MARKER = "mlflow-run.json"
EXPERIMENT_NAME_VAR = "MLFLOW_EXPERIMENT_NAME"
MLFLOW_RUN_ID_VAR = "MLFLOW_RUN_ID"


@dataclass(frozen=True)
class RunChoice:
    """The run the chief logs into.

    Attributes:
        run_id: its id.
        how: why this one ("run_id=", "handed over by the runner", "active", "backup", "marker", "new").
        owned: this training started it: the logger ends it when training ends.
        existing: it existed before this process (what it holds is read first).
    """

    run_id: str
    how: str
    owned: bool
    existing: bool


def choose_run(client: Any, *, explicit: str | None, environ: Mapping[str, str], active: str | None,
               restored: str | None, marker_dir: str | None, experiment_name: str | None, run_name: str | None,
               tags: Mapping[str, str]) -> RunChoice:
    """The run to log into (see the module docstring for the order); a new one is created on the server."""
    handed = handed_run_id(environ) or environ.get(MLFLOW_RUN_ID_VAR, "").strip() or None
    for run_id, how in ((explicit, "run_id="), (handed, "handed over by the runner"), (active, "active")):
        if run_id:
            return RunChoice(run_id, how, owned=False, existing=True)
    marked = read_marker(marker_dir) if marker_dir else None
    for run_id, how in ((restored, "backup"), (marked, "marker")):
        if run_id and _alive(client, run_id):
            return RunChoice(run_id, how, owned=True, existing=True)
        if run_id:
            log.warning("the MLflow run %s this training started before its restart is gone from the tracking "
                        "server (deleted?): logging to a new run", run_id)
    experiment = experiment_id(client, experiment_name, environ)
    run = client.create_run(experiment, run_name=run_name, tags=dict(tags))
    if marker_dir:
        write_marker(marker_dir, run.info.run_id)
    return RunChoice(run.info.run_id, "new", owned=True, existing=False)


def experiment_id(client: Any, name: str | None, environ: Mapping[str, str]) -> str:
    """The experiment a new run goes to: `name` (created if missing), MLFLOW_EXPERIMENT_ID/_NAME, else Default."""
    if name is None:
        handed = handed_experiment(environ)
        if handed is not None:
            return handed
        name = environ.get(EXPERIMENT_NAME_VAR, "").strip() or None
    if name is None:
        return "0"
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(name)


def check_experiment(client: Any, experiment: str | None, name: str | None, uri: str) -> None:
    """Refuse, before training, an experiment id (MLFLOW_EXPERIMENT_ID) the server does not have, or one that is not
    the experiment MLFLOW_EXPERIMENT_NAME names there (MLflow's own rule for the two). Every run of the search would
    fail to be made: said once, here, not as a warning per call while the trials run."""
    if experiment is None:
        return
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_experiment(experiment)
    except MlflowException:
        found = None
    if found is None or getattr(found, "lifecycle_stage", "active") != "active":
        raise ConfigError(f"{EXPERIMENT_ID_VAR}={experiment!r} is no active experiment of the tracking server at "
                          f"{safe_uri(uri)}. Fix: unset {EXPERIMENT_ID_VAR} (and name the experiment with "
                          f"{EXPERIMENT_NAME_VAR}), or set it to an experiment of that server")
    if name:
        named = client.get_experiment_by_name(name)
        if named is not None and named.experiment_id != found.experiment_id:
            raise ConfigError(f"{EXPERIMENT_ID_VAR}={experiment!r} and {EXPERIMENT_NAME_VAR}={name!r} name two "
                              f"experiments (the name's id is {named.experiment_id!r}). Fix: unset one of them")


def logged_steps(client: Any, run_id: str) -> dict[str, set[int]]:
    """Every metric of the run and the steps it has values at."""
    keys = client.get_run(run_id).data.metrics.keys()
    return {key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys}


def logged_params(client: Any, run_id: str) -> dict[str, str]:
    return dict(client.get_run(run_id).data.params)


def _alive(client: Any, run_id: str) -> bool:
    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except Exception as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
            return False
        raise


# -- the marker ---------------------------------------------------------------------------------

def read_marker(directory: str) -> str | None:
    """The run id in `directory`/mlflow-run.json, or None (no marker, or one this user did not write)."""
    path = os.path.join(directory, MARKER)
    if not os.path.exists(path):
        return None
    try:
        data = json.loads(files.read_bytes(path, f"the MLflow run marker {path!r}"))
    except (OSError, ValueError) as exc:
        log.warning("could not read %s (%s): it is ignored", path, exc)
        return None
    value = data.get("run_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def write_marker(directory: str, run_id: str) -> None:
    """Write `directory`/mlflow-run.json atomically (the directory is checked to be this user's)."""
    files.check_dir(directory, "backup_dir")
    files.write_bytes(os.path.join(directory, MARKER), json.dumps({"run_id": run_id}).encode())


def remove_marker(directory: str) -> None:
    """Remove the marker, and `directory` too when nothing else is left in it (the backups are gone)."""
    files.remove(os.path.join(directory, MARKER))
    try:
        os.rmdir(directory)
    except OSError:
        pass


# -- the server ------------------------------------------------------------------------------------

#: How long the chief's first look at an HTTP tracking server may take (MLflow's own client retries for minutes).
PROBE_SECONDS = 15.0


def probe(uri: str) -> None:
    """Refuse, before training, an http(s) tracking URI where no server answers (any HTTP answer will do).

    MLflow's client retries a refused connection for about four minutes (measured: 250 s) before it fails.
    """
    parts = urlsplit(uri.strip())
    if uri.strip() and parts.scheme in ("", "file"):
        _refused_file_store(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    import http.client
    import socket

    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if parts.scheme == "https":  # (TLS and its certificates are MLflow's business: reaching the port is enough)
            socket.create_connection((parts.hostname, port), timeout=PROBE_SECONDS).close()
            return
        connection = http.client.HTTPConnection(parts.hostname, port, timeout=PROBE_SECONDS)
        try:
            connection.request("GET", "/health")
            connection.getresponse()
        finally:
            connection.close()
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise ConfigError(f"MLflowLogger could not reach MLflow at {safe_uri(uri)} ({TRACKING_URI_VAR} or "
                          f"tracking_uri=): {type(exc).__name__}: {exc}. Fix: start the tracking server, or point "
                          f"{TRACKING_URI_VAR} at one this task can reach") from None


def _refused_file_store(uri: str) -> None:
    """MLflow 3 refuses a directory as its tracking store (unless MLFLOW_ALLOW_FILE_STORE=true): say so now, not
    in a warning per logged call."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(uri)
    except MlflowException as exc:
        raise ConfigError(f"MLflow refuses the tracking store {safe_uri(uri)} ({TRACKING_URI_VAR} or tracking_uri=): "
                          f"{str(exc).split('. ')[0]}. Fix: a database, e.g. {TRACKING_URI_VAR}=sqlite:///mlflow.db, "
                          "or a tracking server (mlflow server), or MLFLOW_ALLOW_FILE_STORE=true") from None


def safe_uri(uri: str) -> str:
    """`uri` without a password or token in it (printed in messages)."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
