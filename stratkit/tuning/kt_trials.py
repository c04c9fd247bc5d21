"""A distributed KerasTuner tuner's trials: the one it runs now, its files on the store, how it stops.

`TunerState` is what `stratkit.tuning.kt_tuner.distribute` attaches to a tuner:
its session, the user's oracle, the trial running now (`Lease` and KerasTuner
`Trial`), and each trial's files:

* a run's files (KerasTuner's best-epoch checkpoint, its build config) go to the
  store under the run (`search_store.SearchStore.upload`) before the run's end is
  reported; the service then names that run the trial's, and the older runs'
  files are removed;
* `fetch` brings a trial's files into this tuner's own trial directory (for
  `get_best_models`, for Hyperband's next round), `prepare_run` brings a lost
  trial's last run's checkpoint back before a new run resumes it from its backup;
* `_resumable` gives KerasTuner's SaveBestEpoch a state in the trial's backups
  (its best value so far) and uploads each checkpoint it writes;
* `LeaseGuard` stops a trial at its next step once its lease was lost.

KerasTuner internals used here: `Tuner._get_checkpoint_fname`,
`Tuner._get_build_config_fname`, SaveBestEpoch's `best_value` and
`_save_model` (see `kt_tuner.PRIVATE`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import keras
import keras_tuner

from stratkit import status
from stratkit.tuning.kt_oracle import KerasTunerPlanner
from stratkit.tuning.planner import trial_seed
from stratkit.tuning.session import Session
from stratkit.tuning.tracked import epoch_report

#: A trial's local marker: which run's files its directory holds.
FILES_MARKER = "stratkit-files.json"

log = status.logger(__name__)


def to_json(value: Any) -> Any:
    """`value` as the wire carries it (tuples as lists, numpy numbers as text when JSON has none)."""
    return json.loads(json.dumps(value, default=str))


class LeaseLost(keras_tuner.errors.FatalError):
    """This tuner's lease on its trial was taken back (the trial runs on another tuner now)."""


class FirstBuildFailed(keras_tuner.errors.FatalError):
    """The search's first trial's model did not build: the search cannot work."""


class LeaseGuard(keras.callbacks.Callback):
    """Stops a trial at its next step once its lease is lost."""

    def __init__(self, lease: Any) -> None:
        super().__init__()
        self.lease = lease

    def _check(self, *args: Any, **kwargs: Any) -> None:
        if self.lease.lost.is_set():
            raise LeaseLost(f"trial {self.lease.trial_id} (run {self.lease.run}): the lease was taken back")

    on_epoch_begin = on_train_batch_begin = on_test_batch_begin = _check


class EpochReports(keras.callbacks.Callback):
    """Sends each epoch's metrics of a trial to the search (its MLflow run: `stratkit.tuning.tracked`)."""

    def __init__(self, client: Any, lease: Any) -> None:
        super().__init__()
        self.client = client
        self.lease = lease

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.lease.lost.is_set():
            self.client.report(self.lease, epoch_report(epoch, logs))


@dataclass
class RunningTrial:
    """The trial this tuner runs now."""

    lease: Any
    trial: Any
    builds: int = 0


class TunerState:
    """What a distributed tuner holds: its session, the original oracle, the trial it runs, the options."""

    def __init__(self, tuner: Any, session: Session, planner: KerasTunerPlanner, backups: bool) -> None:
        self.tuner = tuner
        self.session = session
        self.planner = planner
        self.original = planner.oracle
        self.backups = backups
        self.current: RunningTrial | None = None
        self.building: RunningTrial | None = None
        #: The oracle that answers once the search ended (the service's, or this tuner's copy of the results).
        self.final_oracle: Any = None
        self._staging: str | None = None

    @property
    def staging(self) -> str:
        """This tuner's own directory for backups on their way to a store URL (tuners of one machine must not
        share one: `Backup`'s default is per run and rank, the same for every tuner)."""
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix=f"stratkit-tune-{os.getpid()}-")
        return self._staging

    @property
    def client(self) -> Any:
        return self.session.client

    @property
    def seed(self) -> int:
        return int(self.client.config.get("seed", self.planner.seed))

    def build_seed(self, trial_id: str, build: int) -> int:
        """The seed of a trial's build number `build` (an execution's own; a reload's the first's)."""
        seed = trial_seed(self.seed, trial_id)
        return seed if build == 0 else trial_seed(seed, f"execution-{build}")

    # -- a trial's files --------------------------------------------------------------------------
    def trial_dir(self, trial_id: str) -> str:
        return self.tuner.get_trial_dir(trial_id)

    def _files(self, trial_id: str) -> list[str]:
        tuner = self.tuner
        return [tuner._get_checkpoint_fname(trial_id), tuner._get_build_config_fname(trial_id)]

    def _held_run(self, trial_id: str) -> int | None:
        try:
            with open(os.path.join(self.trial_dir(trial_id), FILES_MARKER)) as handle:
                return int(json.load(handle)["run"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _hold(self, trial_id: str, run: int | None) -> None:
        path = os.path.join(self.trial_dir(trial_id), FILES_MARKER)
        if run is None:
            if os.path.exists(path):
                os.remove(path)
            return
        with open(path, "w") as handle:
            json.dump({"run": run}, handle)

    def fetch(self, trial_id: str) -> None:
        """Make this tuner's trial directory hold the trial's files (the run that ended it), from the store."""
        run = self.client.files_run(trial_id)
        if run is None or self._held_run(trial_id) == run:
            return
        self._clear(trial_id)
        self.session.store.download(trial_id, run, self.trial_dir(trial_id))
        self._hold(trial_id, run)

    def _clear(self, trial_id: str) -> None:
        self._hold(trial_id, None)
        for path in self._files(trial_id):
            if os.path.exists(path):
                os.remove(path)

    def upload(self, lease: Any, path: str) -> None:
        """One of this run's files to the store (a checkpoint as SaveBestEpoch writes it, the build config); a
        multi-worker trial group's chief uploads them, its followers hold the same."""
        if os.path.exists(path) and self.session.writes:
            self.session.store.upload(lease.trial_id, lease.run, path)

    def prepare_run(self, lease: Any) -> None:
        """Before a run trains: this tuner's trial directory holds what the trial's last run left (a run that
        takes over a lost trial continues its SaveBestEpoch), else nothing."""
        self._clear(lease.trial_id)
        earlier = [r for r in self.session.store.runs_with_files(lease.trial_id) if r < lease.run]
        if earlier:
            self.session.store.download(lease.trial_id, earlier[-1], self.trial_dir(lease.trial_id))

    def end(self, trial: Any) -> None:
        """The trial's end: its files to the store, then the result to the service (which makes them the trial's)."""
        current = self.current
        if current is None or current.trial.trial_id != trial.trial_id:
            raise RuntimeError(f"end_trial({trial.trial_id}) outside the trial this tuner runs")
        lease = current.lease
        if lease.lost.is_set() or not self.session.writes:  # (a group's follower: its chief ends the trial)
            return
        for path in self._files(trial.trial_id):
            self.upload(lease, path)
        if self.client.end(lease, {"trial": to_json(trial.get_state())}):
            self._hold(trial.trial_id, lease.run)
            try:
                self.session.store.remove_runs(trial.trial_id, keep=lease.run)
            except OSError as exc:  # the store keeps an old run's files: space, not correctness
                log.debug("could not remove older runs of trial %s: %s", trial.trial_id, exc)

    def finished(self) -> None:
        """The search ended: answer queries from its results from now on (and drop the backups' staging)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if self.session.service is not None:
            self.final_oracle = self.planner.oracle
        else:
            copy = KerasTunerPlanner(self.original, exact=self.planner.exact)
            copy.restore((self.client.final or {}).get("summary") or {})
            self.final_oracle = copy.oracle
        self.session.finish()


def resumable(saver: Any, uploaded: Any) -> bool:
    """Give KerasTuner's SaveBestEpoch (`saver`) a state in the trial's backups (its best value so far), and
    call `uploaded()` after each checkpoint it writes (a run that takes over the trial starts from both).
    False when `saver` is not one (another callback, or a KerasTuner whose SaveBestEpoch changed)."""
    if type(saver).__name__ != "SaveBestEpoch" or not hasattr(saver, "_save_model") \
            or not hasattr(saver, "best_value"):
        return False
    save = saver._save_model

    def save_and_upload() -> None:
        save()
        uploaded()

    def get_state() -> dict[str, Any]:
        value = float(saver.best_value)
        return {"best_value": value if value == value and abs(value) != float("inf") else None}

    def set_state(values: dict[str, Any]) -> None:
        if values.get("best_value") is not None:
            saver.best_value = float(values["best_value"])

    saver._save_model, saver.get_state, saver.set_state = save_and_upload, get_state, set_state
    return True


__all__ = ["EpochReports", "FILES_MARKER", "FirstBuildFailed", "LeaseGuard", "LeaseLost", "RunningTrial", "TunerState",
           "resumable", "to_json"]
