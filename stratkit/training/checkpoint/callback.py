"""The Keras callback that ties it together: resume at the position reached, back up on schedule and on notice.

`Trainer.fit(backup_dir=..., backup_every=...)` puts it first in its
callbacks; with your own `model.fit`, `stratkit.callbacks.Backup` is this
class (put it last in `callbacks`, see `Backup`). When it acts:

* `decide_position` (the trainer asks before building the input) and
  `on_train_begin`: every worker proposes its newest intact backup, they take
  the MIN (so workers that died a moment apart resume together), load its
  weights and optimizer state, check its run facts and model, put the random
  state back, and start catching preemption notices;
* `on_epoch_begin` of the resumed epoch: the metrics' running state (after
  Keras's reset), the callbacks' state, and the plan that starts the epoch at
  the backup's step (`stratkit.strategy.keras_compat.resume_step`);
* `on_train_batch_begin`, every step boundary: the agreement (a notice on any
  worker, the chief's clock: `agreement.py`), then a step backup when due, or
  the preemption backup and the exit;
* `on_epoch_end`: the epoch backup (without `backup_every`; it keeps the
  name and place today's epoch backups have); the callbacks' state of that
  epoch's end is added at the next `on_epoch_begin`, when every callback ran;
* `on_train_end`: a finished run's backups are removed (Keras semantics).

With `backup_dir` a store URL (``s3://``, ``gs://``, ``az://``, ``hdfs://``) each worker writes the same
backups to a local staging directory and they reach the store beside training, committed by the chief
(`remote`, `uploads`, `commit`); `file://` URLs and paths are local directories as ever.

A complete backup is told to the callbacks defining `on_backup_written(position=, global_step=, reason=,
directory=)` (reason "epoch", the `backup_every` text or "preemption"): Ray Train's `RayReportCallback`.

Size: one Keras callback's hooks over one run's state (the position, the pending epoch backup, the resume
plan); each hook is a few lines that call the modules deciding (`store`, `remote`, `preemption`, `state`).
Split by hook, that state would be shared between modules instead of held by one object.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any

import keras

from stratkit import status, storage, timeline
from stratkit.errors import ConfigError
from stratkit.strategy import keras_compat
from stratkit.strategy.keras_compat import callback_state as keras_state
from stratkit.strategy.keras_compat import resume_step
from stratkit.training.checkpoint import (agreement, callbacks_state, preemption, remote as remote_lib,
                                         state as state_lib, store)
from stratkit.training.checkpoint.data import DataPosition, data_position, model_fit_position
from stratkit.training.checkpoint.layout import WHAT, Position, worker_backup_dir
from stratkit.training.checkpoint.schedule import Clock, parse_every
from stratkit.training.checkpoint.state import RunFacts

log = status.logger(__name__)


class Backup(keras.callbacks.Callback):
    """Back up on a schedule (every epoch, every K steps, or every D of time) and on a preemption notice.

    Args:
        backup_dir: the backup directory (the chief's files; other workers' in `workers/worker-N`), or a store
            URL (``s3://bucket/run``, ``gs://``, ``az://``/``abfs://``, ``hdfs://``: checked before step 1,
            each worker stages locally and uploads beside training, see `stratkit.training.checkpoint.remote`).
        every: None (after every epoch), a positive int (every that many global steps) or a duration
            ("30s", "10min", "1h": at the first step boundary after that much time, the chief's clock).
        is_chief: this worker saves to backup_dir itself (default: `stratkit.detect()`).
        rank: this worker's rank, which names its subdirectory (default: `stratkit.detect()`).
        agree_on_epoch: callable(int) -> int, the MIN over all workers (a collective); identity on one worker
            (default: from the model's strategy).
        agree_flags: callable(list[int]) -> list[int], a SUM over all workers to agree on notices and the chief's
            clock every few steps with (`agreement.Agreement`); default: `agreement.for_fit`, no collective.
        keep: backups kept on disk (at least 2, so a corrupt newest one has a fallback).
        resume_note: a warning the chief gives when it resumes (what a resume does not continue).
        facts: the run's global batch, steps per epoch and dataset size (checked against the backup's).
        data: how the resumed epoch's data starts (`Trainer.fit` sets it; default: Keras's iterator replayed).
        staging: with a URL, the local root each worker stages its backups under (default:
            STRATKIT_BACKUP_STAGING, else the temporary directory: `remote.staging_root`).
    """

    def __init__(self, backup_dir: str, every: Any = None, *, is_chief: bool | None = None,
                 rank: int | None = None, agree_on_epoch: Any = None, agree_flags: Any = None, keep: int = 2,
                 resume_note: str | None = None, facts: RunFacts | None = None,
                 data: DataPosition | None = None, staging: str | None = None) -> None:
        super().__init__()
        self.every = parse_every(every)
        self.backup_dir = os.fspath(backup_dir)
        local = storage.local_path(self.backup_dir, WHAT)  # file:// -> its path; "s3:/b" (a slash missing) refused
        self.backup_dir = local if local is not None else self.backup_dir.rstrip("/")
        self.staging = staging
        self._remote: remote_lib.RemoteBackups | None = None
        self.is_chief = is_chief
        self.rank = rank
        self.agree_on_epoch = agree_on_epoch
        self.agree_flags = agree_flags
        self.keep = max(int(keep), 2)
        self.resume_note = resume_note
        self.facts = facts
        self.data = data
        self.data_record: dict | None = None  # the input's order a resume must read again (`bind_input`)
        self.notice = preemption.Notice(status.preemption_signals())  # checks the variable up front
        self._agreement: Any = agreement.Agreement(None)
        self.resumed_epoch = 0
        self.resumed = Position()
        self._decided: tuple[Position, Any, Any] | None = None
        self._preempting = False
        self._checked = False
        self._change: str | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self._past_end = False
        self._state: dict | None = None
        self._arrays: dict = {}
        self._pending: tuple[Position, int] | None = None  # an epoch backup whose callbacks' state comes next
        self._first_epoch = True
        self._first_batch = True
        self._plan: resume_step.EpochPlan | None = None
        self._epoch = 0
        self._epoch_start = 0       # global steps done when this epoch began
        self._last = Position()     # the newest backup of this run (written or resumed from)
        self._siblings: list[Any] = []
        self._csv: list[Any] = []

    # -- where this worker stands -----------------------------------------------------------------
    @property
    def directory(self) -> str:
        """This worker's backup directory (with a store URL: its local staging directory)."""
        self._place()
        if self._remote is not None:
            return self._remote.directory
        return worker_backup_dir(self.backup_dir, bool(self.is_chief), int(self.rank or 0))

    def _place(self) -> None:
        if self.is_chief is None or self.rank is None:
            from stratkit.cluster import detect

            spec = detect()
            self.is_chief = spec.is_chief if self.is_chief is None else self.is_chief
            self.rank = max(spec.worker_rank, 0) if self.rank is None else self.rank
        if self._remote is None and storage.is_url(self.backup_dir):
            self._remote = remote_lib.RemoteBackups(self.backup_dir, rank=int(self.rank), is_chief=bool(self.is_chief),
                                                    keep=self.keep, staging=self.staging)

    def _collectives(self) -> None:
        """Default agreements from the model's strategy: collectives on several workers, identity on one."""
        if self.agree_on_epoch is not None:
            return
        strategy = getattr(self.model, "distribute_strategy", None)
        multi = strategy is not None and keras_compat._is_multi_worker_collective(strategy)
        from stratkit.strategy import collectives

        self.agree_on_epoch = (lambda v: collectives.min_over_workers(strategy, v)) if multi else (lambda v: v)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._siblings = [c for c in keras_state.callbacks_of(self) or [] if c is not self]

    # -- the resume decision --------------------------------------------------------------------
    def decide(self) -> int:
        """The epoch this run resumes at (0: from the start), agreed by every worker (see `decide_position`)."""
        return self.decide_position().epoch

    def decide_position(self) -> Position:
        """The position this run resumes at, agreed by every worker; decided once.

        The trainer asks before it builds the input pipeline (the data order and
        position depend on it); `on_train_begin` then loads that backup.
        """
        if self._decided is not None:
            return self._decided[0]
        self._collectives()
        self._place()
        if self._remote is not None:  # the store's newest committed backup, read back into local staging
            from stratkit.cluster import detect

            self._decided = self._remote.decide(self.agree_on_epoch, max(detect().num_workers, 1))
            agreed, point, _ = self._decided
            if point is not None:
                self._state, self._arrays = point.state(), point.arrays()
            return agreed
        store.files.check_dir(self.backup_dir, WHAT)
        directory = self.directory
        store.prepare_dir(directory)  # every worker cleans only its own directory
        local = store.find_resume_point(directory)
        proposal = local.position
        if not self.is_chief:
            # A worker new to this world (an elastic launch grew, or its host was replaced) has no copy of its
            # own; the chief's intact copy in backup_dir will do (every worker holds the same weights).
            proposal = max(proposal, store.readable_position(self.backup_dir))
        agreed = Position.from_key(int(self.agree_on_epoch(proposal.key)))
        point = local if agreed == local.position else None
        if agreed != Position() and point is None:
            # Another worker has only an older backup (it died first), or this worker lost its copy: every
            # worker holds the same weights, so any intact copy of that position will do.
            others = [self.backup_dir]
            workers = os.path.join(self.backup_dir, "workers")
            if os.path.isdir(workers):
                others += sorted(os.path.join(workers, name) for name in os.listdir(workers))
            point = store.find_copy(agreed, [directory] + [d for d in others if d != directory])
            if point is None:
                raise ConfigError(f"backup_dir={self.backup_dir!r}: the cluster resumes at {agreed} but this "
                                  f"worker has no intact backup of it in {directory!r}. Fix: keep backup_dir on "
                                  "storage every worker can read, or move backup_dir away to start over")
        self._decided = (agreed, point, local)
        if point is not None:
            self._state = point.state()
            self._arrays = point.arrays()
        return agreed

    @property
    def saved_data(self) -> dict | None:
        """What the backup being resumed recorded of its input's order (a table's snapshot), or None."""
        self.decide_position()
        return None if self._state is None else self._state.get("data")

    @property
    def saved_facts(self) -> RunFacts | None:
        """The run facts the backup being resumed recorded (None: no backup, or one without a state file)."""
        self.decide_position()
        return None if self._state is None else RunFacts.from_dict(self._state.get("run"))

    def check_run(self, facts: RunFacts) -> str | None:
        """Refuse a resume whose run facts do not continue the backup's (see `state.check_facts`).

        Returns what changed that a resume accepts (said when training starts), or None.
        """
        self.facts = facts
        position = self.decide_position()
        self._checked = True
        self._change = None
        if self._state is not None:
            self._change = state_lib.check_facts(RunFacts.from_dict(self._state.get("run")), facts, position.epoch,
                                                 position.step, self.backup_dir)
        return self._change

    def bind_input(self, data: Any, prepared: Any, *, world_size: int, replicas: int) -> None:
        """`Trainer.fit`'s input for this run (`inputs.PreparedData`): check the run facts, plan the data's start.

        Raises:
            ConfigError: the run cannot continue the backup's (a different global batch mid-epoch, ...).
        """
        facts = RunFacts(global_batch_size=prepared.global_batch_size, steps_per_epoch=prepared.steps_per_epoch,
                         dataset_rows=prepared.num_examples, world_size=world_size, replicas=replicas,
                         data_kind=prepared.kind)
        self.check_run(facts)
        self.data_record = getattr(prepared, "record", None)
        saved = self.saved_facts
        self.data = data_position(data, prepared.kind, prepared.replay, self.decide_position(),
                                  world_changed=saved is not None and saved.world_size != world_size)

    # -- Keras hooks ----------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        position = self.decide_position()
        self.notice = preemption.Notice(status.preemption_signals())
        self._agreement.close()  # a fit that raised without release(): its threads end here; then this fit's
        self._agreement = agreement.for_fit(getattr(self.model, "distribute_strategy", None), self.agree_flags)
        self._agreement.start(self.notice)
        _, point, local = self._decided
        if position != Position():
            if local.note and point is local:
                store.warn(local.note)
            state = self._state or {}
            state_lib.check_manifest(state.get("model", {}).get("variables"), self.model, point.path)
            change = self._change if self._checked or self.facts is None else self.check_run(self.facts)
            store.load(self.model, point)
            state_lib.restore_random(self.model, state.get("model", {}))
            keras_compat.set_resume_epoch(self.model, position.epoch)  # Keras's own hand-over; fit reads it once
            self._csv = callbacks_state.continue_csv_logs(self._siblings, position.epoch)
            if position.step > 0 or state.get("phase") == "batch":
                if not keras_compat.install_resume_step():
                    raise ConfigError(f"{point.path} is a mid-epoch backup, and this Keras cannot start an epoch "
                                      "at a step. Fix: install a Keras stratkit supports (stratkit info)")
            log.info("resumed from %s at %s", point.source or point.path, position)
            timeline.mark("backup loaded")
            if self.is_chief:
                for note in (change and f"the run changed since the backup: {change}", self.resume_note,
                             (self.data or DataPosition()).note if position.step else None):
                    if note:
                        store.warn(note)
        elif local.note:
            store.warn(local.note)
        self.resumed, self.resumed_epoch, self._last = position, position.epoch, position
        steps = int((self.params or {}).get("steps") or 0)
        saved = (self._state or {}).get("position", {}).get("global_step")
        self._epoch_start = (int(saved) if saved is not None else position.epoch * steps) - position.step
        self._clock = Clock(self.every, bool(self.is_chief))
        epochs = (self.params or {}).get("epochs")
        # Every worker decides the same (same position, same epochs); only the chief says it.
        self._past_end = store.past_end(position.epoch, epochs, self.backup_dir, say=bool(self.is_chief))
        self.notice.install()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._pending is not None:  # the last epoch backup: its callbacks' state, now that every callback ran
            position, global_step = self._pending
            self._pending = None
            self._write(position, global_step, reason="epoch", weights=False)
        self._epoch = epoch
        if not self._first_epoch:
            return
        self._first_epoch = False
        state = self._state or {}
        if self.resumed != Position() and state:
            restore = state.get("callbacks")
            if restore is not None:
                extra = callbacks_state.restore(self._siblings, restore, self._arrays)
                if extra and self.is_chief:
                    store.warn(f"the backup holds the state of callbacks this run does not pass: {', '.join(extra)}")
            elif self.is_chief:
                store.warn("this backup holds no callbacks' state (written before the end of its epoch's "
                           "callbacks, or by an older stratkit): EarlyStopping, ReduceLROnPlateau and the like "
                           "start afresh")
            if state.get("phase") != "batch":
                state_lib.restore_learning_rate(self.model, state.get("model", {}))
        if self.resumed.step > 0 or state.get("phase") == "batch":
            state_lib.restore_metrics(self.model, state.get("model", {}))  # Keras reset them just now
            data = self.data or model_fit_position(self.resumed)
            self._plan = resume_step.EpochPlan(self.resumed.step, skip=data.skip, steps_before=self._epoch_start,
                                               before=data.before)
            resume_step.start_next_epoch_at(self._plan)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._first_batch:
            self._first_batch = False
            if self._plan is not None:
                if not self._plan.done:
                    raise ConfigError("the resumed epoch did not start at the backup's step (another callback "
                                      "ran an epoch of its own first). Fix: put stratkit's Backup last in callbacks")
                state_lib.restore_learning_rate(self.model, (self._state or {}).get("model", {}))
        global_step = self._epoch_start + batch
        position = Position(self._epoch, batch)
        noticed, due = self._agreement.decide(self.notice.noticed, self._clock.time_due())
        if noticed:
            self._preempted(position, global_step)
        elif (due or self._clock.steps_due(global_step)) and position > self._last:
            self._write(position, global_step, reason=self.every.text)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        steps = int((self.params or {}).get("steps") or 0)
        self._epoch_start += steps
        if self.every.per_step:
            return
        position = Position(epoch + 1, 0)
        # The weights now (the callbacks after this one, and Keras's History, have not run their on_epoch_end
        # yet); the state once they have, at the next on_epoch_begin. A backup without it resumes as today's
        # epoch backups do (callbacks start afresh).
        self._write(position, self._epoch_start, reason="epoch", state=False)
        self._pending = (position, self._epoch_start)

    def release(self) -> None:
        """Give back what a `fit` took (the signal handlers, the model's resume epoch, CSVLoggers' mode).

        `on_train_end` does it; after a `fit` that raised (Keras then skips
        `on_train_end`) the caller does (`Trainer.fit` does). A preempted process
        keeps its handlers until it is gone.
        """
        if self.model is not None:
            keras_compat.set_resume_epoch(self.model, None)
        resume_step.disarm()
        self._agreement.close()
        if self._remote is not None:  # (a fit that raised: its newest backup still gets a chance to reach the store)
            self._remote.close(flush=0.0 if self._preempting else remote_lib.FLUSH_AFTER_ERROR)
        if not self._preempting:
            self.notice.uninstall()
        callbacks_state.restore_csv_append(self._csv)
        self._csv = []

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._remote is not None:
            self._remote.close()  # training is done: uploads not yet started are dropped, the one under way ends
        self.release()
        self._decided = None  # a later fit with this callback decides again
        self._checked = False
        past_end = self._past_end
        self._reset_run()
        if self.notice.noticed and self.is_chief:
            log.info("%s came after the last step: training is complete", self.notice.describe())
        if past_end:
            return  # nothing was trained: the backup stays (every worker decides the same)
        self._remove_finished()

    # -- writing ------------------------------------------------------------------------------------
    def _write(self, position: Position, global_step: int, *, reason: str, weights: bool = True,
               state: bool = True) -> float:
        """Write this worker's backup at `position` (`state=False`: the weights only); returns the seconds it took."""
        started = time.monotonic()
        content, arrays = None, None
        if state:
            values, arrays = callbacks_state.collect(self._siblings)
            content = {"format": state_lib.FORMAT, "phase": "epoch_end" if reason == "epoch" else "batch",
                       "reason": reason, "time": time.time(),
                       "position": {"epoch": position.epoch, "step": position.step, "global_step": global_step},
                       "run": (self.facts or RunFacts()).as_dict(), "model": state_lib.model_state(self.model),
                       "callbacks": values}
            if self.data_record is not None:
                content["data"] = self.data_record
        store.write_backup(self.model, self.directory, position, content, arrays, keep=self.keep, weights=weights)
        if state and self._remote is not None:
            self._remote.submit(position, global_step)  # to the store beside training (complete backups only)
        self._last = max(self._last, position)
        self._clock.restart()
        seconds = time.monotonic() - started
        for told in [getattr(c, "on_backup_written", None) for c in self._siblings] if state else []:
            if callable(told):  # a complete backup: the callbacks that carry it elsewhere (Ray Train's report)
                told(position=position, global_step=global_step, reason=reason, directory=self.directory)
        return seconds

    def _preempted(self, position: Position, global_step: int) -> None:
        """Write the preemption backup at this boundary (unless it is the newest one already) and exit."""
        seconds = 0.0
        if position > self._last:
            seconds = self._write(position, global_step, reason="preemption")
        noticed = self.notice.describe()
        waited = time.monotonic() - self.notice.at if self.notice.noticed else 0.0
        where = f"{position} (global step {global_step})"
        saved = (f"backup written in {seconds:.2f} s" if seconds else "the newest backup is already at this step")
        saved += f" ({self.directory})"
        if self._remote is not None:  # the exit waits for it to be in the store (within the grace period)
            saved += "; " + self._remote.final(self._last, self.notice.at if self.notice.noticed else None)
        self._preempting = True
        message = (f"preempted: {noticed}" + (f", {waited:.2f} s ago" if self.notice.noticed else "") +
                   f"; stopped at {where}; {saved}; exiting with status "
                   f"{status.EXIT_PREEMPTED} (preempted): a restart resumes here")
        if self.notice.repeats:
            message += f" ({self.notice.repeats} more notice(s) came during the save)"
        log.warning("%s", message)
        resume_step.disarm()  # (the signal handlers stay: a further SIGTERM must not end the exit with -15)
        preemption.exit_soon()
        raise preemption.Preempted(message)

    def _remove_finished(self) -> None:
        """Training finished: the backups served their purpose. Each worker removes its own copy; the chief the rest.

        Two barriers (the collective that agrees on the resume position): cleaning must not start before
        every worker's last save has landed (measured: a slow worker re-created backup_dir/workers after the
        chief had removed it), and the chief removes the shared directory only after the workers removed theirs.
        """
        if self._remote is not None:
            self.agree_on_epoch(0)  # every worker's uploads have ended: nothing reaches the store after this
            self._remote.remove_local()
            self._remote.remove()
            return
        self.agree_on_epoch(0)
        if not self.is_chief:
            store.remove_backup(self.directory)
            shutil.rmtree(self.directory, ignore_errors=True)
        self.agree_on_epoch(0)
        if not self.is_chief:
            return
        store.remove_backup(self.backup_dir)
        shutil.rmtree(os.path.join(self.backup_dir, "workers"), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.backup_dir)  # only if nothing of the user's is left in it

