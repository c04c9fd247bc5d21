"""`MLflowLogger`: the whole cluster's training as one MLflow run, logged by the chief.

Every worker runs the callback (it sits in every worker's `fit`); only the chief
talks to MLflow. When it acts:

* made (before `fit` is called): MLflow's own Keras/TensorFlow autologging is
  switched off in the process (`autolog.py`: it would start one run per worker);
* the first step of `fit` (after a resumed backup gave the callbacks their state):
  the chief picks the run (`runs.choose_run`: given, handed over by the runner,
  active, kept in the backup, or new), reads what it already holds, and records
  the params (`params.run_params`);
* each epoch's end: that epoch's metrics (`logs`) at step = epoch, unless the run
  has them already (a restart re-trains the epochs after its backup);
* the end of `fit`: the model, with its signature, and the run ended (FINISHED)
  when this training started it.

The run id is part of the callbacks' state a backup keeps (`get_state`), and of a
marker beside the backups until the run ends, so a run resumed after a crash,
a preemption or a resize continues the same MLflow run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import keras

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.training.tracking import autolog, runs
from stratkit.training.tracking import params as params_lib
from stratkit.training.tracking.handoff import TRACKING_URI_VAR

log = status.logger(__name__)


class MLflowLogger(keras.callbacks.Callback):
    """Log a cluster's training to one MLflow run, from the chief; a resumed run continues the same run.

    Works with `stratkit.Trainer.fit(callbacks=[...])` and with your own `model.fit` under
    `stratkit.make_strategy()`, on one process or N workers, under every engine. The other
    workers log nothing. A restart after a crash, a preemption or a resize continues the
    run with `backup_dir` (`Trainer.fit(backup_dir=...)` or `stratkit.callbacks.Backup`),
    and each epoch is logged once. Creating the logger switches MLflow's own Keras and
    TensorFlow autologging off in the process: the logger records what it would, once.

    The run is, first that applies: `run_id`; the run the runner's driver handed over
    (`LocalRunner`/`SparkRunner`/`RayRunner` inside `with mlflow.start_run():`); the run
    active in the chief's process; the run this training started before a restart; a new
    run in `experiment_name`.

    Args:
        experiment_name: the experiment of a new run (default: `MLFLOW_EXPERIMENT_ID` /
            `MLFLOW_EXPERIMENT_NAME`, else MLflow's Default experiment).
        run_id: log into this existing run.
        run_name: the name of a new run (default: MLflow's).
        tracking_uri: the tracking server or store (default: `MLFLOW_TRACKING_URI`, as MLflow reads it).
        params: more params to record (strings or numbers).
        tags: tags of a new run.
        log_model: log the trained model at the end of `fit` (a Keras model, with its signature).
        model_name: the logged model's name.
        signature: the model's `mlflow.models.ModelSignature` (default: from its inputs and outputs).
        global_batch_size: the global batch, recorded as a param; `Trainer.fit` tells the logger, a
            plain `model.fit` does not.
        is_chief: whether this process logs (default: `stratkit.detect().is_chief`).

    Attributes:
        run_id: the run logged to (known on the chief from the first step of `fit`).
    """

    def __init__(self, experiment_name: str | None = None, *, run_id: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None, params: Mapping[str, Any] | None = None,
                 tags: Mapping[str, str] | None = None, log_model: bool = True, model_name: str = "model",
                 signature: Any = None, global_batch_size: int | None = None, is_chief: bool | None = None) -> None:
        super().__init__()
        for name, value in (("experiment_name", experiment_name), ("run_id", run_id), ("run_name", run_name),
                            ("tracking_uri", tracking_uri)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"MLflowLogger({name}=...) must be a non-empty string or None: got {value!r}")
        if not isinstance(model_name, str) or not model_name.strip():
            raise ConfigError(f"MLflowLogger(model_name=...) must be a non-empty string: got {model_name!r}")
        self.experiment_name = experiment_name
        self.requested_run_id = run_id
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.extra_params = {str(k): str(v) for k, v in (params or {}).items()}
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.log_model = bool(log_model)
        self.model_name = model_name
        self.signature = signature
        self.global_batch_size = global_batch_size
        self.is_chief = is_chief
        self.run_id: str | None = None
        self._restored: str | None = None
        self._choice: runs.RunChoice | None = None
        self._client: Any = None
        self._logged: dict[str, set[int]] = {}
        self._backup: Any = None
        if self._chief() or "mlflow" in sys.modules:  # (another worker that never imported MLflow has no autolog on)
            _import_mlflow()
            autolog.switch_off(say=self._chief())
        if self._chief():
            runs.probe(tracking_uri or os.environ.get(TRACKING_URI_VAR, ""))

    # -- what other parts of stratkit tell it --------------------------------------------------------
    def set_global_batch_size(self, global_batch_size: int | None) -> None:
        """`Trainer.fit` tells the logger the global batch it trains with (unless one was given)."""
        if self.global_batch_size is None:
            self.global_batch_size = global_batch_size

    def get_state(self) -> dict[str, Any]:
        """The run id, kept in each backup with the callbacks' state."""
        return {"run_id": self.run_id} if self.run_id else {}

    def set_state(self, state: dict[str, Any]) -> None:
        """A resumed backup's state: the run to continue."""
        value = state.get("run_id") if isinstance(state, dict) else None
        self._restored = value if isinstance(value, str) and value else None

    # -- Keras hooks -------------------------------------------------------------------------------
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._backup = _backup_of(self)  # (Keras's CallbackList is setting the model: the one moment it is known)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._choice = None
        if "mlflow" in sys.modules and not autolog.is_off():
            # MLflow came after the logger was made: its autologging (if on) started with this fit, too late to
            # stop; off from now on, and said.
            autolog.switch_off(say=True, late=True)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._choice is None and self._chief():
            self._start()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self._chief():
            return
        if self._choice is None:
            self._start()
        metrics = {}
        for key, value in (logs or {}).items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if epoch not in self._logged.get(key, ()):
                metrics[key] = number
        if not metrics:
            if logs:
                log.info("MLflow run %s has epoch %d's metrics from before the restart: not logged again",
                         self.run_id, epoch)
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        try:
            self._client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, epoch) for k, v in metrics.items()])
        except Exception as exc:  # noqa: BLE001 - a tracking hiccup must not end hours of training
            log.warning("could not log epoch %d's metrics to MLflow run %s: %s", epoch, self.run_id,
                        self._redact(exc))
            return
        for key in metrics:
            self._logged.setdefault(key, set()).add(epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restored = None  # a later fit with this logger is a run of its own (as with autologging)
        if not self._chief():
            return
        if self._choice is None:
            self._start()
        choice = self._choice
        assert choice is not None
        if self.log_model:
            self._log_model()
        if choice.owned:
            try:
                self._client.set_terminated(self.run_id, "FINISHED")
            except Exception as exc:  # noqa: BLE001
                log.warning("could not end MLflow run %s: %s", self.run_id, self._redact(exc))
            directory = self._backup_dir()
            if directory:
                runs.remove_marker(directory)

    # -- the chief's work --------------------------------------------------------------------------
    def _chief(self) -> bool:
        if self.is_chief is None:
            from stratkit.cluster import detect

            self.is_chief = detect().is_chief
        return bool(self.is_chief)

    def _backup_dir(self) -> str | None:
        directory = getattr(self._backup, "backup_dir", None)
        return os.fspath(directory) if directory else None

    def _start(self) -> None:
        """Pick the run, read what it holds, record the params: the first step of `fit`, on the chief."""
        import mlflow
        from mlflow.entities import Param

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)  # the chief's MLflow logs here (the model too)
        uri = mlflow.get_tracking_uri()
        if runs.safe_uri(uri) != uri:  # MLflow prints "View run at <the URI>" when a run ends: not with a password
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        try:
            self._client = mlflow.MlflowClient(uri)
            active = mlflow.active_run()
            choice = runs.choose_run(
                self._client, explicit=self.requested_run_id, environ=os.environ,
                active=active.info.run_id if active is not None else None, restored=self._restored,
                marker_dir=self._backup_dir(), experiment_name=self.experiment_name, run_name=self.run_name,
                tags=_context_tags(self.tags))
            self.run_id = choice.run_id
            self._logged = runs.logged_steps(self._client, choice.run_id) if choice.existing else {}
            before = runs.logged_params(self._client, choice.run_id) if choice.existing else {}
            from stratkit.cluster import detect

            spec = detect()
            wanted = {**params_lib.run_params(self.model, spec, global_batch_size=self.global_batch_size,
                                              epochs=(self.params or {}).get("epochs"),
                                              steps_per_epoch=(self.params or {}).get("steps")),
                      **self.extra_params}
            new = [Param(k, v) for k, v in wanted.items() if k not in before]
            if new:
                self._client.log_batch(choice.run_id, params=new)
            if choice.existing:
                self._note_resume(before, wanted)
            if choice.owned and self._backup_dir() and runs.read_marker(self._backup_dir()) != choice.run_id:
                runs.write_marker(self._backup_dir(), choice.run_id)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the first contact: a wrong URI or server fails here, clearly
            raise ConfigError(f"MLflowLogger could not reach MLflow at {runs.safe_uri(uri)} "
                              f"({TRACKING_URI_VAR} or tracking_uri=): {self._redact(exc, uri)}. Fix: start the "
                              "tracking server, or point MLFLOW_TRACKING_URI at it (its credentials in "
                              "MLFLOW_TRACKING_TOKEN / MLFLOW_TRACKING_USERNAME and _PASSWORD)") from None
        self._choice = choice
        log.info("logging to MLflow run %s (%s) at %s", choice.run_id, choice.how, runs.safe_uri(uri))

    def _note_resume(self, before: Mapping[str, str], wanted: Mapping[str, str]) -> None:
        """A continued run: one line per start in the tag `stratkit.resumes`, with what changed (a resize)."""
        position = getattr(self._backup, "resumed", None)
        where = f"epoch {position.epoch} step {position.step}" if position is not None else "the start"
        changed = ", ".join(f"{k} {before[k]} -> {v}" for k, v in wanted.items() if k in before and before[k] != v)
        line = f"resumed at {where}" + (f" ({changed})" if changed else "")
        try:
            tags = self._client.get_run(self.run_id).data.tags
            text = "\n".join(filter(None, [tags.get("stratkit.resumes", ""), line]))
            self._client.set_tag(self.run_id, "stratkit.resumes", text[-5000:])
        except Exception as exc:  # noqa: BLE001
            log.warning("could not note the resume on MLflow run %s: %s", self.run_id, self._redact(exc))

    def _log_model(self) -> None:
        import mlflow

        try:
            if self._has_model():
                log.info("MLflow run %s has its model %r from before the restart: not logged again", self.run_id,
                         self.model_name)
                return
            if mlflow.active_run() is None:  # a logged model goes to the fluent experiment, not to its run's
                mlflow.set_experiment(experiment_id=self._client.get_run(self.run_id).info.experiment_id)
            mlflow.models.Model.log(artifact_path=None, name=self.model_name, flavor=mlflow.keras, run_id=self.run_id,
                                    model=self.model, signature=self.signature or _signature(self.model),
                                    pip_requirements=params_lib.pip_requirements())
        except Exception as exc:  # noqa: BLE001 - the metrics are in; say what is missing
            log.warning("could not log the model to MLflow run %s: %s", self.run_id, self._redact(exc))

    def _has_model(self) -> bool:
        """True when the run has a complete logged model of this name (a restart after it was logged)."""
        run = self._client.get_run(self.run_id)
        found = self._client.search_logged_models(
            experiment_ids=[run.info.experiment_id],
            filter_string=f"source_run_id = '{self.run_id}' AND name = '{self.model_name}'")
        return any(str(getattr(m.status, "name", m.status)) == "READY" for m in found)

    def _redact(self, exc: BaseException, uri: str | None = None) -> str:
        """An error's text without the credentials a tracking URI may carry."""
        text = f"{type(exc).__name__}: {exc}"
        for value in (uri, self.tracking_uri, os.environ.get(TRACKING_URI_VAR)):
            if value and runs.safe_uri(value) != value:
                text = text.replace(value, runs.safe_uri(value))
        for secret in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD"):
            if os.environ.get(secret):
                text = text.replace(os.environ[secret], "***")
        return text


def _import_mlflow() -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError("MLflowLogger needs MLflow, which is not installed here. Fix: pip install "
                          "'stratkit[mlflow]' (in every worker's environment)") from None


def _backup_of(callback: keras.callbacks.Callback) -> Any:
    """The `Backup` among the callbacks of this `fit` (its backup_dir holds the run's marker), or None."""
    from stratkit.strategy.keras_compat import callback_state
    from stratkit.training.checkpoint import Backup

    return next((c for c in callback_state.callbacks_of(callback) or [] if isinstance(c, Backup)), None)


def _signature(model: Any) -> Any:
    try:
        from mlflow.keras.utils import get_model_signature

        return get_model_signature(model)
    except Exception as exc:  # noqa: BLE001 - a subclassed model has no declared inputs
        log.warning("the model's signature cannot be read from its inputs (%s): logged without one; pass "
                    "MLflowLogger(signature=mlflow.models.infer_signature(x, model.predict(x)))", exc)
        return None


def _context_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """`tags` with MLflow's context tags of a new run (user, source), as `mlflow.start_run` adds them."""
    try:
        from mlflow.tracking.context import registry

        return dict(registry.resolve_tags(dict(tags)))
    except Exception:  # noqa: BLE001
        return dict(tags)
