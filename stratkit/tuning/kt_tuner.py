"""A KerasTuner tuner on stratkit's search service: the user's script unchanged but one line.

    tuner = stratkit.tune(keras_tuner.Hyperband(build_model, objective="val_loss", max_epochs=9, seed=1))
    tuner.search(x, y, validation_data=(xv, yv))          # unchanged
    best = tuner.get_best_models()[0]                     # unchanged, on every tuner

`distribute(tuner)` keeps the object (its class, its `search`, `get_best_*`,
`results_summary`, a subclass's own `run_trial`/`HyperModel.fit`) and changes
where its trials come from and what they leave behind:

* the oracle moves behind the search service (`stratkit.tuning.session`): in
  this process for `python search.py`, beside worker 0 under `stratkit launch
  --tune`, on the driver for `LocalRunner(tune=True)`; `tuner.oracle` becomes
  an `OracleProxy` that asks it (and, once the search ended, answers from the
  results every tuner received);
* `search` takes each trial as a lease (`client.Lease`) and stops a trial whose
  lease was lost (`LeaseLost` at its next step: another tuner runs it now);
* each trial trains alone, seeded from (the search's seed, its id)
  (`planner.trial_seed`, before its model is built; an execution of several
  gets its own), on this tuner's own devices (Mirrored over its GPUs when it
  has several, else Keras without a strategy; no TF_CONFIG in a tune run), so
  N tuners score as one process;
* a trial's files (the best epoch's weights, the build config) go to the
  search's store per run (`search_store`), so no file system is shared: the
  chief's `get_best_models()` and Hyperband's next rounds read them back;
  with `backups=True` each trial backs up every epoch
  (`stratkit.callbacks.Backup`, its SaveBestEpoch's best value in the
  backup), and a run that takes over a lost trial resumes at its last epoch;
* each tuner of a distributed search works in its own directory
  (`<directory>/<project_name>/tuner-<id>`); the shared state is the store's
  (default `<directory>/<project_name>/stratkit`). KerasTuner's own
  tuner/oracle JSON files are not what resumes a search: the store is.

KerasTuner internals used here (`PRIVATE`, behind `check_version`'s range):
`Tuner._build_hypermodel` (the seed, a parent trial's files),
`Tuner._build_and_fit_model` (the callbacks), `BaseTuner._try_run_and_update_trial`
(one trial, as KerasTuner runs it), `Tuner._get_checkpoint_fname` and
`_get_build_config_fname` (which files), SaveBestEpoch's `best_value` and
`_save_model`.
The trial this tuner runs and its files: `kt_trials`; the planner side: `kt_oracle`.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import keras_tuner
from keras_tuner.engine.trial import TrialStatus

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.training.checkpoint import Backup
from stratkit.tuning.devices import own_devices_strategy
from stratkit.tuning.kt_oracle import KerasTunerPlanner, trial_from_state
from stratkit.tuning import environment
from stratkit.tuning import tracking as tracking_lib
from stratkit.tuning.kt_trials import (EpochReports, FirstBuildFailed, LeaseGuard, LeaseLost, RunningTrial, TunerState,
                                       resumable, to_json)
from stratkit.tuning.planner import check_library_version
from stratkit.tuning.session import open_session
from stratkit.tuning.tracked import TrackedPlanner

#: KerasTuner releases this adapter ran on; below the floor is refused, above the newest a warning.
TESTED = ((1, 4, 8),)
FLOOR = (1, 4, 8)
PRIVATE = ("Tuner._build_hypermodel", "Tuner._build_and_fit_model", "BaseTuner._try_run_and_update_trial",
           "Tuner._get_checkpoint_fname", "Tuner._get_build_config_fname", "SaveBestEpoch.best_value",
           "SaveBestEpoch._save_model")

log = status.logger(__name__)


def check_version(version: str | None = None) -> None:
    """Refuse a KerasTuner below `FLOOR`; warn above the newest tested release."""
    check_library_version("keras-tuner", version or keras_tuner.__version__, FLOOR, TESTED, "keras-tuner>=1.4.8,<1.5", "keras-tuner<1.5", log)


class OracleProxy:
    """What `tuner.oracle` is on a distributed tuner: KerasTuner's calls, answered by the search service
    (during the search) or by the results (after it)."""

    def __init__(self, state: TunerState) -> None:
        self._state = state
        self._oracle = state.original
        self.multi_worker = False
        self.should_report = True

    def __getattr__(self, name: str) -> Any:
        if name in ("objective", "max_trials", "allow_new_entries", "tune_new_entries", "seed", "hyperparameters"):
            return getattr(self._oracle, name)
        raise AttributeError(f"stratkit's distributed oracle has no attribute {name!r}")

    @property
    def _final(self) -> Any:
        return self._state.final_oracle

    @property
    def verbose(self) -> Any:
        return self._oracle.verbose

    @verbose.setter
    def verbose(self, value: Any) -> None:
        if self._state.session.service is not None:  # the display is the service's (KerasTuner's chief prints)
            self._state.planner.oracle.verbose = value

    def _set_project_dir(self, directory: str, project_name: str) -> None:
        pass

    def save(self) -> None:
        """The search's state is the store's (`search.json`): nothing to save here."""

    def reload(self) -> None:
        pass

    def get_space(self) -> Any:
        if self._final is not None:
            return self._final.get_space()
        return keras_tuner.HyperParameters.from_config(self._state.client.query("space"))

    def update_space(self, hyperparameters: Any) -> None:
        if self._final is not None:
            self._final.update_space(hyperparameters)
        else:
            self._state.client.query("update_space", space=to_json(hyperparameters.get_config()))

    def create_trial(self, tuner_id: str) -> Any:
        raise RuntimeError("a distributed tuner takes its trials from stratkit's search service (tuner.search)")

    def update_trial(self, trial_id: str, metrics: dict[str, Any], step: int = 0) -> Any:
        current = self._state.current
        if current is None or current.trial.trial_id != trial_id:
            raise RuntimeError(f"update_trial({trial_id}) outside the trial this tuner runs")
        self._state.client.report(current.lease, {"metrics": to_json(metrics), "step": step})
        return current.trial

    def end_trial(self, trial: Any) -> None:
        self._state.end(trial)

    def get_trial(self, trial_id: str) -> Any:
        if self._final is not None:
            return self._final.get_trial(trial_id)
        return trial_from_state(self._state.client.query("trial", trial_id=trial_id))

    def get_best_trials(self, num_trials: int = 1) -> list[Any]:
        if self._final is not None:
            return self._final.get_best_trials(num_trials)
        return [trial_from_state(s) for s in self._state.client.query("best", num_trials=num_trials)]

    def remaining_trials(self) -> Any:
        if self._final is not None:
            return self._final.remaining_trials()
        return self._state.client.query("remaining")

    @property
    def trials(self) -> dict[str, Any]:
        if self._final is not None:
            return self._final.trials
        return {k: trial_from_state(v) for k, v in self._state.client.query("trials").items()}

    def get_state(self) -> dict[str, Any]:
        return (self._final or self._oracle).get_state()


class DistributedTuner:
    """The methods a distributed tuner's class gets first in its MRO (`distribute` makes the class)."""

    _stratkit: TunerState

    def search(self, *fit_args: Any, **fit_kwargs: Any) -> None:
        state = self._stratkit
        if "verbose" in fit_kwargs:
            self.oracle.verbose = fit_kwargs.get("verbose")
        if state.final_oracle is not None:
            return  # this search ended already
        self.on_search_begin()
        while True:
            self.pre_create_trial()
            lease = state.client.next()
            if lease is None:
                break
            trial = trial_from_state(lease.payload["trial"])
            trial.status = TrialStatus.RUNNING
            state.current = RunningTrial(lease, trial)
            try:
                self.on_trial_begin(trial)
                self._try_run_and_update_trial(trial, *fit_args, **fit_kwargs)
                if not lease.lost.is_set():
                    self.on_trial_end(trial)
            except LeaseLost:
                log.warning("tuner %d stopped trial %s (run %d): another tuner runs it now", state.session.tuner,
                            lease.trial_id, lease.run)
            except FirstBuildFailed as exc:
                message = str(exc)
                state.session.abort(message)
                raise ConfigError(message) from None
            finally:
                state.client.release(lease)
                state.current = None
        state.finished()
        self.on_search_end()

    def _build_hypermodel(self, hp: Any) -> Any:
        state = self._stratkit
        parent = hp.values.get("tuner/trial_id")
        if parent is not None:  # Hyperband's next round starts from the last round's trial: its files
            state.fetch(str(parent))
        building = state.building or state.current
        first = building is not None and building is state.current and building.lease.first and building.builds == 0
        if building is not None:
            keras.utils.set_random_seed(state.build_seed(building.trial.trial_id, building.builds))
            building.builds += 1
        try:
            model = super()._build_hypermodel(hp)  # type: ignore[misc]
        except Exception as exc:
            if not first:
                raise
            values = {k: v for k, v in hp.values.items() if not k.startswith("tuner/")}
            raise FirstBuildFailed(f"the model-building function fails on the search's first hyperparameters "
                                   f"{values}: {type(exc).__name__}: {exc}. No trial ran. Fix: the build function "
                                   "(it must build a model for every value of the search space)") from exc
        if first:
            state.client.built(building.lease)  # type: ignore[union-attr]
        optimizer = getattr(model, "optimizer", None)
        if state.backups and self.distribution_strategy is None and optimizer is not None and model.built \
                and not optimizer.built:
            # A backup restores the optimizer's state only into built variables; Keras builds them at the first
            # step, after the backup loaded (a strategy builds them first). Built now, a resumed trial trains on
            # exactly as it would have (and an unresumed one as without: its slots start at zero either way).
            optimizer.build(model.trainable_variables)
        return model

    def _build_and_fit_model(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        state = self._stratkit
        current = state.current
        if current is None:
            return super()._build_and_fit_model(trial, *args, **kwargs)  # type: ignore[misc]
        lease = current.lease
        callbacks = list(kwargs.get("callbacks") or [])
        for callback in callbacks:
            path = getattr(callback, "filepath", None)
            resumable(callback, lambda path=path: state.upload(lease, path) if state.backups else None)
        backup = None
        rank, size = state.session.group
        if state.backups and getattr(self, "executions_per_trial", 1) == 1:
            state.prepare_run(lease)
            backup = Backup(state.session.store.backup_path(trial.trial_id), is_chief=rank == 0, rank=rank,
                            staging=None if state.session.store.local else os.path.join(state.staging, "backups"))
        extra = [backup] if backup is not None else []
        if isinstance(state.planner, TrackedPlanner) and state.session.writes:  # each epoch to its MLflow run
            extra.append(EpochReports(state.client, lease))
        # A group's trial is not stopped mid-trial (its chief alone would stop): the service refuses its end.
        guard = [LeaseGuard(lease)] if size == 1 else []
        kwargs["callbacks"] = [*guard, *callbacks, *extra]
        try:
            return super()._build_and_fit_model(trial, *args, **kwargs)  # type: ignore[misc]
        finally:
            if backup is not None:
                backup.release()

    def load_model(self, trial: Any) -> Any:
        state = self._stratkit
        state.fetch(trial.trial_id)
        state.building = RunningTrial(None, trial)
        try:
            return super().load_model(trial)  # type: ignore[misc]
        finally:
            state.building = None

    def save(self) -> None:
        """The search's state is on its store (`search.json`); KerasTuner's own files would only mislead a
        restart (they are reloaded before stratkit sees the tuner)."""

    def reload(self) -> None:
        pass


_CLASSES: dict[type, type] = {}


def _distributed_class(cls: type) -> type:
    if issubclass(cls, DistributedTuner):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (DistributedTuner, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def distribute(tuner: Any, *, store: str | os.PathLike[str] | None = None, exact: bool = True,
               backups: bool = True, lease_seconds: float | None = None, tracking: str = "auto") -> Any:
    """Make `tuner` (a KerasTuner tuner) one tuner of stratkit's search; returns the same object.

    Args:
        tuner: `keras_tuner.RandomSearch(...)`, `Hyperband(...)`, `BayesianOptimization(...)`, `GridSearch`,
            or a subclass (its `run_trial` and `HyperModel.fit` run unchanged).
        store: where the search keeps its state and trial files: a store URL (``s3://bucket/search``,
            ``gs://``, ``az://``) or a directory every tuner reaches; default
            ``<directory>/<project_name>/stratkit`` (one machine, or a shared file system).
        exact: propose trials as one process would (see `kt_oracle`): N tuners then try the same trials
            and get the same scores as one process. False: KerasTuner's own parallel order (more trials at
            once where a round would wait).
        backups: back up each trial every epoch on the store, so a trial its tuner lost resumes at its
            last epoch on another (`executions_per_trial` > 1: the trial starts over).
        lease_seconds: how long a trial stays its tuner's without a heartbeat (default 30, or
            STRATKIT_TUNE_LEASE_SECONDS).
        tracking: MLflow (`stratkit.tuning.tracking`): "auto" logs each trial as a child run of the run the
            engine's driver handed over (`with mlflow.start_run(): runner.run(...)`) or the run active here,
            if any; "mlflow" always (a new parent run for the search when none); "off" never.

    Raises:
        ConfigError: not a KerasTuner tuner, an unsupported keras-tuner, the store cannot be used, the tuners
            build different searches, or (before any trial) another tuner found one of these.
    """
    if not isinstance(tuner, keras_tuner.engine.base_tuner.BaseTuner):
        raise ConfigError(f"stratkit.tune() got a {type(tuner).__name__}, not a KerasTuner tuner. Fix: stratkit.tune("
                          "keras_tuner.RandomSearch(...)) (or Hyperband, BayesianOptimization, GridSearch)")
    if isinstance(tuner, DistributedTuner):
        return tuner
    check_version()
    if isinstance(getattr(tuner, "oracle", None), OracleProxy):
        return tuner
    planner: Any = KerasTunerPlanner(tuner.oracle, exact=exact)
    path = environment.resolve(os.fspath(store) if store is not None else os.path.join(tuner.project_dir, "stratkit"))
    tracked = tracking_lib.options(tracking, run_name=f"search {tuner.project_name}",
                                   params={"oracle": type(tuner.oracle).__name__, "max_trials": tuner.oracle.max_trials,
                                           "objective": getattr(tuner.oracle.objective, "name", tuner.oracle.objective),
                                           "seed": tuner.oracle.seed})
    if tracked is not None:
        planner = TrackedPlanner(planner, tracked, key=path)
    env = environment.from_environ()
    group = env.group if env is not None else (0, 1)
    if getattr(tuner, "distribution_strategy", None) is None and hasattr(tuner, "distribution_strategy"):
        tuner.distribution_strategy = own_devices_strategy(group)  # before any TensorFlow op (a group's MWMS)
    session = open_session(planner, store=path, lease_seconds=lease_seconds, strategy=tuner.distribution_strategy)
    if session.distributed:  # tuners on one machine must not share KerasTuner's working files
        worker = f"-worker-{group[0]}" if group[0] else ""
        tuner.project_name = os.path.join(tuner.project_name, f"tuner-{session.tuner}{worker}")
    tuner.tuner_id = f"tuner{session.tuner}"
    state = TunerState(tuner, session, planner, backups)
    tuner._stratkit = state
    tuner.oracle = OracleProxy(state)
    tuner.__class__ = _distributed_class(type(tuner))
    return tuner


__all__ = ["PRIVATE", "DistributedTuner", "LeaseGuard", "LeaseLost", "OracleProxy", "check_version", "distribute"]
