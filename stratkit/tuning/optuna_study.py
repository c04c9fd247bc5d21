"""An Optuna study on stratkit's search service: `study.optimize(objective, n_trials=...)` on N workers.

    study = stratkit.tune(optuna.create_study(direction="minimize", pruner=optuna.pruners.MedianPruner()))
    study.optimize(objective, n_trials=8)     # the study's 8 trials, on however many workers run this
    print(study.best_params)                  # every worker holds the whole study afterwards

The same script runs as one process, as N workers under `stratkit launch
--tune --workers N`, and in `stratkit.LocalRunner(num_workers=N, tune=True)`.
`distribute(study)` keeps the user's study object and its objective; what
changes (docs/tuning.md, "Optuna"):

* the study lives on the search service (`optuna_planner`: the chief's or the
  driver's, no database), persisted to the search's store, so a restarted chief
  resumes it; each worker's study speaks to it (`optuna_storage`) while it
  optimizes, and holds the whole study in memory once the search ended;
* `n_trials` and `timeout` are the study's, not each worker's; `study.stop()`
  (an objective's, a callback's, `MaxTrialsCallback`'s) stops the study: no
  trial starts after it, the running ones finish;
* the sampler runs on the service only, in one order, so a seeded sampler
  tries one process's trials where it does not depend on results still
  running (RandomSampler, GridSampler, TPE's random start);
* a worker that dies or hangs mid-trial loses its trial: marked FAIL, a retry
  with its parameters runs on another worker (Optuna's heartbeat retry);
* each trial runs alone on this worker's devices (Mirrored over its GPUs when it
  has several), seeded from (seed, trial number) when `seed` is not None;
* the first trial is the gate: no other trial starts before it reported once
  (or ended), and an objective that raises there ends the search with a
  ConfigError on every worker (as Optuna reports the failed trial), before any
  other trial ran. A later trial's error (not in `catch`) is raised by its
  worker, as `optimize` raises in one process, and ends the search for all;
* `tracking` (MLflow, `stratkit.tuning.tracking`): the study is a parent run
  and each trial a child run, with its parameters, its reports
  (`trial.report(value, step)`: metric `intermediate_value` at that step), its
  value (metric `score`, one objective) and its state (FINISHED, KILLED for
  pruned, FAILED with the error or why its worker was lost).

Optuna internals used (`PRIVATE`, behind `check_version`'s range): a study's
`_storage` and `_study_id` (the storage a study keeps its trials in),
`optuna.study._frozen.FrozenStudy` (what a storage lists), and the prefix of
the names Optuna gives unnamed studies (`DEFAULT_STUDY_NAME_PREFIX`).

Imports Optuna; Keras only if the objective's module did.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import optuna
from optuna.storages import InMemoryStorage
from optuna.storages._base import DEFAULT_STUDY_NAME_PREFIX
from optuna.trial import TrialState

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.strategy.server import RUN_DIR_VAR
from stratkit.tuning import environment
from stratkit.tuning import optuna_codec as codec
from stratkit.tuning import tracking as tracking_lib
from stratkit.tuning.devices import own_devices_strategy
from stratkit.tuning.optuna_planner import ERROR_ATTR, LOST_ATTR, OptunaPlanner
from stratkit.tuning.optuna_storage import PlannedSampler, RemotePruner, SearchStorage, TrialLost
from stratkit.tuning.planner import check_library_version
from stratkit.tuning.session import open_session
from stratkit.tuning.tracked import TrackedPlanner

#: Optuna releases this adapter ran on; below the floor is refused, above the newest minor a warning.
TESTED = ((5, 1, 0),)
FLOOR = (5, 1, 0)
PRIVATE = ("Study._storage", "Study._study_id", "optuna.study._frozen.FrozenStudy",
           "optuna.storages._base.DEFAULT_STUDY_NAME_PREFIX")
#: How often a lost trial runs again by default (Optuna's RetryHeartbeatStaleTrialCallback max_retry).
RETRIES = 2
#: The studies this process optimized so far.
_SEARCHES = itertools.count()

log = status.logger(__name__)
#: Each trial's line, as Optuna's optimize logs it (Optuna's verbosity applies).
optuna_log = logging.getLogger("optuna.study.study")


def check_version(version: str | None = None) -> None:
    """Refuse an Optuna below `FLOOR`; warn above the newest tested minor release."""
    check_library_version("optuna", version or optuna.__version__, FLOOR, TESTED, "optuna>=5.1,<6", "optuna<5.2", log)


class _Options:
    """What `distribute` attaches to a study: the options, its own sampler and pruner, whether it optimized."""

    def __init__(self, store: str | None, seed: int | None, lease_seconds: float | None, retries: int,
                 tracking: str) -> None:
        self.store, self.seed, self.lease_seconds, self.retries = store, seed, lease_seconds, retries
        self.tracking = tracking
        self.session: Any = None
        self.optimized = False


def _seed_trial(seed: int) -> None:
    """Seed what a trial draws from (Python, NumPy, Keras and its backend when the objective imported them)."""
    random.seed(seed)
    if "keras" in sys.modules:
        sys.modules["keras"].utils.set_random_seed(seed)
    elif "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def _default_store(search: int) -> tuple[str, bool]:
    """The store of the process's `search`-th study given none, and whether this process removes it after the
    search: the run's own, as Optuna's in-memory study lives as long as its process. One process: a temporary
    directory it removes. A tune run: in the run's private directory, which the engine removes after the run
    (`STRATKIT_RUN_DIR`: a restarted chief of the launch still finds it; a tuner that heard the end late reads it
    there); an engine without one: the temporary directory, named after the run's token."""
    env = environment.from_environ()
    if env is None:
        return tempfile.mkdtemp(prefix="stratkit-optuna-"), True
    run_dir = os.environ.get(RUN_DIR_VAR, "").strip()
    if run_dir:
        return os.path.join(run_dir, f"optuna-study-{search}"), False
    digest = hashlib.sha256(f"stratkit-optuna:{env.token}:{search}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"stratkit-optuna-{digest}"), False


def _spec(study: optuna.Study) -> dict[str, Any]:
    """The study as the planner starts it: name (and whether the user gave it), directions, attributes, trials."""
    name = study.study_name
    return {"name": name, "named": not name.startswith(DEFAULT_STUDY_NAME_PREFIX),
            "directions": [d.value for d in study.directions],
            "user_attrs": codec.json_safe(study.user_attrs, "the study's user attributes"),
            "system_attrs": codec.json_safe(study._storage.get_study_system_attrs(0),
                                            "the study's system attributes"),
            "trials": [codec.trial_to_json(t) for t in study.get_trials(deepcopy=False)]}


def _study_params(study: optuna.Study, n_trials: int | None, timeout: float | None) -> dict[str, Any]:
    """What a tracked study's parent run records of it."""
    return {"sampler": type(study.sampler).__name__, "pruner": type(study.pruner).__name__,
            "directions": ",".join(d.name.lower() for d in study.directions), "n_trials": n_trials,
            "timeout": timeout}


def _failure(trial: optuna.Trial, error: BaseException) -> str:
    """A failed trial as Optuna's optimize logs it."""
    return f"Trial {trial.number} failed with parameters: {trial.params} because of the following error: {error!r}."


class DistributedStudy:
    """The methods a distributed study's class gets first in its MRO (`distribute` makes the class)."""

    _stratkit: _Options

    def optimize(self, func: Callable[[optuna.Trial], Any], n_trials: int | None = None, timeout: float | None = None,
                 n_jobs: int = 1, catch: Iterable[type[Exception]] | type[Exception] = (),
                 callbacks: Iterable[Callable[[optuna.Study, Any], None]] | None = None, gc_after_trial: bool = False,
                 show_progress_bar: bool = False) -> None:
        """Optimize the study on every worker of the search (Optuna's arguments; see the module's docstring).

        Args:
            n_trials: the study's trials, across every worker (a lost trial's retry does not count again);
                None: until `timeout` or `study.stop()`.
            timeout: seconds after the search's start (the service's clock) after which no trial starts.
            n_jobs: 1 (a worker runs one trial at a time: run more workers instead).
            catch: as Optuna's: the errors that fail a trial without ending the study.
            callbacks: as Optuna's, called after each trial this worker ran.
            gc_after_trial: as Optuna's, after each trial this worker ran.
            show_progress_bar: not shown (Optuna's log lines report each trial).

        Raises:
            ConfigError: a bad argument, the store cannot be used, the workers optimize different studies, or
                the objective failed on the first trial (on every worker, before any other trial ran).
            SearchFailed: another worker's trial raised (this worker's own trial's error is raised as itself).
        """
        options = self._stratkit
        if n_jobs != 1:
            raise ConfigError(f"study.optimize(n_jobs={n_jobs}): a stratkit study runs one trial at a time on each "
                              "worker. Fix: drop n_jobs and run more workers (stratkit launch --tune --workers N)")
        if options.optimized:
            raise ConfigError("study.optimize() ran already on this distributed study. Fix: optimize once with the "
                              "study's whole n_trials, or stratkit.tune() a new study for another search")
        for name, value in (("n_trials", n_trials), ("timeout", timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"study.optimize({name}={value!r}): a positive number or None. Fix: e.g. "
                                  f"{name}={8 if name == 'n_trials' else 600}")
        if show_progress_bar:
            log.warning("study.optimize(show_progress_bar=True) is not shown in a stratkit study: Optuna's log "
                        "lines report each trial")
        catch = tuple(catch) if isinstance(catch, Iterable) else (catch,)
        env = environment.from_environ()
        if env is not None and env.group[1] > 1:  # a group's followers learn their trials through a Keras strategy
            raise ConfigError(f"this worker is worker {env.group[0]} of a multi-worker trial group of "
                              f"{env.group[1]} (--workers-per-trial {env.group[1]}), which KerasTuner's searches "
                              "use; an Optuna study runs one trial per worker. Fix: drop --workers-per-trial, or "
                              "build a MultiWorkerMirrored strategy inside the objective yourself")
        options.optimized = True
        storage: SearchStorage = self._storage  # type: ignore[attr-defined]
        planner = OptunaPlanner(_spec(self), self.sampler, self.pruner,  # type: ignore[attr-defined]
                                n_trials=None if n_trials is None else int(n_trials), timeout=timeout,
                                seed=options.seed, retries=options.retries)
        search = next(_SEARCHES)  # every worker runs the same script: its k-th study is theirs
        store, remove = ((environment.resolve(options.store), False) if options.store is not None
                         else _default_store(search))
        served: Any = planner
        try:
            tracked = tracking_lib.options(options.tracking, run_name=f"study {self.study_name}",  # type: ignore
                                           params=_study_params(self, n_trials, timeout))
            if tracked is not None:
                served = TrackedPlanner(planner, tracked, key=store)
            session = open_session(served, store=store, lease_seconds=options.lease_seconds)
        except BaseException:
            if remove:
                shutil.rmtree(store, ignore_errors=True)
            raise
        planner.plan_ahead = session.role != "alone"  # one process samples as Optuna does: nothing runs beside
        sampler, pruner = self.sampler, self.pruner  # type: ignore[attr-defined]
        planned = PlannedSampler(storage)
        storage.client = session.client
        self.sampler, self.pruner = planned, RemotePruner(storage)  # type: ignore[attr-defined]
        try:
            self._search(session, planned, func, catch, list(callbacks or ()), gc_after_trial)
            storage.finished(session.client.final["summary"])
            session.finish()
        finally:
            storage.client = storage.lease = None
            self.sampler, self.pruner = sampler, pruner  # type: ignore[attr-defined]
            session.close()
            if session.role in ("alone", "host") and isinstance(served, TrackedPlanner):  # its calls: logged now
                served.close(None if served.ended else "study.optimize raised before the study ended")
            if remove:  # one process's own: no other process resumes from it
                shutil.rmtree(store, ignore_errors=True)

    def _search(self, session: Any, planned: PlannedSampler, func: Callable[[optuna.Trial], Any],
                catch: tuple[type[Exception], ...], callbacks: list[Callable[..., None]], collect: bool) -> None:
        """Take the service's trials until the study ends."""
        strategy = own_devices_strategy()
        storage: SearchStorage = self._storage  # type: ignore[attr-defined]
        while True:
            lease = session.client.next()
            if lease is None:
                return
            storage.lease, storage.reported = lease, False
            planned.use(lease.payload.get("plan") or [])
            try:
                self._run_trial(session, lease, strategy, func, catch, callbacks)
            finally:
                session.client.release(lease)
                storage.lease = None
                if collect:
                    gc.collect()

    def _run_trial(self, session: Any, lease: Any, strategy: Any, func: Callable[[optuna.Trial], Any],
                   catch: tuple[type[Exception], ...], callbacks: list[Callable[..., None]]) -> None:
        """One trial, as Optuna's optimize runs it: the objective, then `tell`, then the callbacks."""
        storage: SearchStorage = self._storage  # type: ignore[attr-defined]
        options = self._stratkit
        if options.seed is not None:
            _seed_trial(lease.seed)
        trial = optuna.Trial(self, int(lease.payload["trial"]))  # type: ignore[arg-type]
        value, state, error = None, None, None
        try:
            with strategy.scope() if strategy is not None else nullcontext():
                value = func(trial)
        except optuna.TrialPruned:
            state = TrialState.PRUNED
        except Exception as exc:  # noqa: BLE001 - Optuna's optimize fails the trial on any error
            if isinstance(exc, TrialLost) or lease.lost.is_set():
                log.warning("trial %d stopped on this worker: %s", trial.number, exc)
                return
            state, error = TrialState.FAIL, exc
            try:  # why, for the trial's MLflow run (stored with its end)
                storage.set_trial_system_attr(trial.number, ERROR_ATTR, _failure(trial, exc)[-4000:])  # ids: numbers
            except TrialLost:
                pass
            if not isinstance(exc, catch) and lease.first and not storage.reported:  # before its end opens the gate
                message = (f"the objective fails on the study's first trial: {_failure(trial, exc)} No other trial "
                           "ran. Fix: the objective (it must run for every value of the search space), or "
                           "study.optimize(catch=(...)) for an error a trial may raise")
                session.abort(message)
                raise ConfigError(message) from exc
        try:  # (a trial the service took back meanwhile is finished there: tell skips it)
            frozen = self.tell(trial, None if state is not None else value, state=state,  # type: ignore[attr-defined]
                               skip_if_finished=True)
        except TrialLost as exc:
            frozen = None
            log.warning("trial %d stopped on this worker: %s", trial.number, exc)
        if frozen is None or LOST_ATTR in frozen.system_attrs:
            return
        if error is not None:
            optuna_log.warning(_failure(trial, error), exc_info=error)
            if not isinstance(error, catch):
                session.abort(f"{_failure(trial, error)} (on tuner {session.tuner}: the study ends, as "
                              "study.optimize raises in one process; catch= lets it go on)", kind="failed")
                raise error
        elif frozen.state == TrialState.COMPLETE:
            optuna_log.info("Trial %d finished with %s: %s and parameters: %s.", frozen.number,
                            *(("value", frozen.values[0]) if len(frozen.values) == 1 else ("values", frozen.values)),
                            frozen.params)
        else:
            optuna_log.info("Trial %d %s.", frozen.number, frozen.state.name.lower())
        for callback in callbacks:
            callback(self, storage.get_trial(frozen.number))

    def stop(self) -> None:
        """Stop the study: no trial starts after this (on any worker); the running ones finish."""
        storage: SearchStorage = self._storage  # type: ignore[attr-defined]
        if not storage.remote:
            raise RuntimeError("`Study.stop` is supposed to be invoked inside an objective function or a callback.")
        storage.client.query("stop", write=True)


_CLASSES: dict[type, type] = {}


def _distributed_class(cls: type) -> type:
    if issubclass(cls, DistributedStudy):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (DistributedStudy, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def distribute(study: Any, *, store: str | os.PathLike[str] | None = None, seed: int | None = 0,
               lease_seconds: float | None = None, retries: int = RETRIES, tracking: str = "auto") -> Any:
    """Make `study` (an `optuna.Study`) one worker's view of stratkit's distributed study; returns the same object.

    Args:
        study: `optuna.create_study(...)` without a storage (stratkit keeps the study), with its trials so far
            (enqueued ones run first, added ones count as Optuna counts them).
        store: where the search keeps the study: a store URL (``s3://bucket/study``, ``gs://``, ``az://``) or a
            directory every worker reaches; a restarted chief resumes the study from it. Default: a directory of
            this run only (like Optuna's in-memory study: gone after the run; a restarted chief of the same
            launch still finds it).
        seed: each trial runs after seeding Python, NumPy and Keras with `trial_seed(seed, trial number)` (a
            retry with its original's), so a trial scores the same on any worker; None: no seeding.
        lease_seconds: how long a trial stays its worker's without a heartbeat (default 30, or
            STRATKIT_TUNE_LEASE_SECONDS).
        retries: how often a lost trial runs again (a new trial with its parameters).
        tracking: MLflow (`stratkit.tuning.tracking`): "auto" logs each trial as a child run of the run the
            engine's driver handed over (`with mlflow.start_run(): runner.run(...)`) or the run active where
            `optimize` runs, if any; "mlflow" always (a new parent run for the study when none); "off" never.

    Raises:
        ConfigError: not an Optuna study, an unsupported optuna, a study on its own storage, or one with
            trials running.
    """
    if not isinstance(study, optuna.Study):
        raise ConfigError(f"stratkit.tune() got a {type(study).__name__}, not an optuna.Study. Fix: "
                          "stratkit.tune(optuna.create_study(...))")
    if isinstance(study, DistributedStudy):
        return study
    check_version()
    if not isinstance(study._storage, InMemoryStorage):
        raise ConfigError(f"stratkit.tune(study): the study {study.study_name!r} keeps its trials in its own "
                          f"storage ({type(study._storage).__name__}); stratkit keeps a distributed study itself (on "
                          "the search's store, no database). Fix: optuna.create_study(...) without storage=, and "
                          "stratkit.tune(study, store=...) to keep it")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"stratkit.tune(study, retries={retries!r}): a whole number >= 0. Fix: e.g. retries=2")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"stratkit.tune(study, seed={seed!r}): a whole number or None. Fix: e.g. seed=0")
    tracking_lib.check_mode(tracking)
    running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if running:
        raise ConfigError(f"stratkit.tune(study): trials {running} of the study are running (study.ask() without "
                          "tell). Fix: tell them first, or stratkit.tune() the study before asking")
    study._storage = SearchStorage(study._storage, study._study_id, study.study_name, study.directions)
    study._stratkit = _Options(os.fspath(store) if store is not None else None, seed, lease_seconds, retries,
                               tracking)
    study.__class__ = _distributed_class(type(study))
    return study


__all__ = ["PRIVATE", "RETRIES", "DistributedStudy", "check_version", "distribute"]
