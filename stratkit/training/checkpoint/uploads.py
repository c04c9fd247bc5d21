"""Uploads beside training: one background thread per process carries its backups to the store.

A step backup costs the local write it costs with a local `backup_dir`; then
`Uploads.submit` hard-links the backup's files into a private outbox (so the
local pruning of older backups cannot pull them from under an upload, and
nothing is copied) and hands the job to the thread. The thread:

* takes the newest job (coalescing: a job not yet started when a newer one
  arrives is dropped, so a slow store never makes uploads fall behind);
* uploads this worker's part (`commit.upload_files`): the chief's weights and
  state, or another worker's state and arrays, then that worker's receipt;
* on the chief, polls the receipts of the backups it uploaded (20 ms, backing
  off to 1 s) and commits the newest whose every part is in: a fence check,
  the manifest, then the pruning of what no resume needs (`commit.prune`). It
  moves on to newer jobs while it waits, so a worker that skipped a backup
  the chief chose delays the next commit, never stops it;
* on a store failure, retries with backoff (0.5 s doubling to 30 s), the
  newest job each time; one warning when uploads start failing, one line when
  they work again (never one per retry). Training goes on throughout, and
  the last committed backup stays the resume point. `close` says which
  backups never reached the store.
* once it sees a newer attempt's claim (this process is a leftover of an
  earlier attempt) it commits and deletes nothing more, and says so once;
* on the chief, paces itself: uploading costs CPU in this process (hashing
  and sending: measured 2.2-3.5 ms per MB to S3, the whole weights file each
  time), which training shares; so the next upload starts no sooner than the
  last one's CPU time (this thread's and fsspec's I/O thread's) divided by
  `share` after it began (`remote`: 2% of one core by default). Backups written
  meanwhile are coalesced: the resume point is a little older, the step time
  untouched. The other workers' parts (their state) are small and not paced,
  so the backup the chief picks has their receipts. A caller waiting for a
  backup (the preemption exit, a flush) is never paced.

`wait` blocks the caller until a position is committed (the chief) or this
worker's part of it is in (the others): the preemption exit waits there.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field

from stratkit import status
from stratkit.storage import Store
from stratkit.training.checkpoint import commit
from stratkit.training.checkpoint.layout import WEIGHTS, WHAT, Position, read_metadata, sha256

log = status.logger(__name__)

RETRY_FIRST, RETRY_MAX = 0.5, 30.0
POLL_FIRST, POLL_MAX = 0.02, 1.0
#: Backups the chief keeps waiting for receipts at once (the oldest is given up beyond it: a newer one commits).
PENDING_MAX = 4
#: The longest `close` waits for an upload already under way (then the thread is left to finish alone).
JOIN_SECONDS = 30.0


def upload_cpu() -> float:
    """CPU seconds of the threads that carry uploads: the calling one, and fsspec's I/O thread, where s3fs,
    gcsfs and adlfs do their work (named "fsspecIO"; other fsspec users' work there counts too)."""
    total = time.thread_time()
    for thread in threading.enumerate():
        if thread.name == "fsspecIO" and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # gone meanwhile, or a platform without thread clocks
                pass
    return total


@dataclass
class Job:
    """One backup of this worker on its way to the store."""

    position: Position
    global_step: int
    name: str
    local: list[commit.LocalFile]
    outbox: str


@dataclass
class Report:
    """What `close` found: the backups that never reached the store, why, and the newest that did."""

    lost: list[Position] = field(default_factory=list)
    failure: str = ""
    reached: Position | None = None


class Uploads:
    """This process's uploads to the store, in one daemon thread started by the first `submit`.

    Args:
        store: the run's store (`backup_dir`).
        attempt: this run's attempt (its generation names the backups; the chief's fence).
        rank: this worker's rank (its part is ``worker-<rank>/``); the chief uploads the weights and commits.
        is_chief: this process commits.
        ranks: every worker's rank (the receipts the chief waits for).
        keep: committed backups kept in the store (at least 2).
        outbox: a private local directory for the jobs' hard links.
        reached: the position already in the store (the backup this run resumed from).
        share: the share of one core the uploads may take on average (1: no pacing).
    """

    def __init__(self, store: Store, attempt: commit.Attempt, *, rank: int, is_chief: bool, ranks: list[int],
                 keep: int, outbox: str, reached: Position | None = None, share: float = 1.0) -> None:
        self.store, self.attempt, self.rank, self.is_chief = store, attempt, rank, is_chief
        self.others = sorted(set(ranks) - {rank}) if is_chief else []
        self.keep = max(int(keep), 2)
        self.outbox = outbox
        self.reached = reached
        self.submitted: Position | None = None
        self.fenced: int | None = None
        self._records: dict[int, commit.Attempt] = {}
        self._cv = threading.Condition()
        self._next: Job | None = None
        self._not_before = 0.0     # after a failure: the backoff
        self.share = min(max(float(share), 1e-3), 1.0)
        self._paced_until = 0.0    # the next upload's earliest start (the CPU share)
        self._urgent = 0           # callers waiting for a backup: no pacing meanwhile
        self._backoff = RETRY_FIRST
        self._pending: dict[str, Job] = {}
        self._poll_at = 0.0
        self._poll_every = POLL_FIRST
        self._failing: float | None = None
        self._failure = ""
        # What never reached the store: the backups a failure touched (those waiting when an operation failed,
        # and those given up for a newer one since the last operation that worked) that never landed.
        self._live: set[Position] = set()      # submitted, neither in the store nor given up
        self._passed: set[Position] = set()    # given up for a newer one since the last operation that worked
        self._hit: set[Position] = set()
        self._landed: set[Position] = set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._count = 0

    # -- the training side ---------------------------------------------------------------------
    def submit(self, position: Position, global_step: int, directory: str) -> None:
        """Send this worker's backup at `position` (just written to `directory`) to the store."""
        names = read_metadata(directory).backups.get(position)
        if names is None or self.fenced is not None or self._stop:
            return
        self._count += 1
        job_dir = os.path.join(self.outbox, f"{self._count:06d}-{position.stem}")
        os.makedirs(job_dir, mode=0o700, exist_ok=True)
        local = []
        for name, digest in sorted(names.items()):
            kind = name.split(".", 1)[1]
            if kind == WEIGHTS and not self.is_chief:
                continue  # identical on every worker (the replica check): the chief's copy is the one uploaded
            source, linked = os.path.join(directory, name), os.path.join(job_dir, name)
            try:
                os.link(source, linked)
            except OSError:
                shutil.copyfile(source, linked)
            relative = name if kind == WEIGHTS else f"{commit.part(self.rank)}/{name}"
            local.append(commit.LocalFile(linked, relative, digest or sha256(linked), os.path.getsize(linked)))
        job = Job(position, global_step, commit.backup_name(self.attempt.generation, position), local, job_dir)
        with self._cv:
            if self._next is not None:
                self._drop(self._next)
            self._next = job
            self.submitted = position
            self._live.add(position)
            if self._failing is not None:
                self._hit.add(position)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stratkit-backup-uploads", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait(self, position: Position, seconds: float) -> bool:
        """Block until `position` is committed (chief) or this worker's part of it is in; False after `seconds`."""
        deadline = time.monotonic() + max(seconds, 0.0)
        with self._cv:
            self._urgent += 1
            # someone waits (a run's end, a notice): the store may be back, so try now and back off from the start,
            # not after a backoff grown over a long outage (up to RETRY_MAX: longer than the wait, seen in CI)
            self._not_before = min(self._not_before, time.monotonic())
            self._backoff = RETRY_FIRST
            self._cv.notify_all()
            try:
                while not self._reached(position) and self.fenced is None and self._alive():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
                return self._reached(position)
            finally:
                self._urgent -= 1

    def close(self, flush: float = 0.0) -> Report:
        """Stop: first wait up to `flush` s for the newest backup, then drop what has not started, let the
        upload under way finish (up to `JOIN_SECONDS`), and say what never reached the store."""
        if flush > 0 and self.submitted is not None:
            self.wait(self.submitted, flush)
        with self._cv:
            self._stop = True
            newest = self.submitted
            if self._next is not None:
                self._drop(self._next)
                self._next = None
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(JOIN_SECONDS)
        with self._cv:
            if self._failing is not None:
                self._hit |= self._live | self._passed
            self._pending.clear()
            lost = sorted(p for p in self._hit - self._landed if newest is None or p <= newest)
        shutil.rmtree(self.outbox, ignore_errors=True)
        return Report(lost, self._failure, self.reached)

    @property
    def failing(self) -> str:
        """Why uploads are failing now ("" while they work)."""
        return self._failure if self._failing is not None else ""

    # -- the thread ----------------------------------------------------------------------------
    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _reached(self, position: Position) -> bool:
        return self.reached is not None and self.reached >= position

    def _drop(self, job: Job) -> None:
        """Give `job` up for a newer backup (holding the lock)."""
        self._live.discard(job.position)
        self._passed.add(job.position)
        shutil.rmtree(job.outbox, ignore_errors=True)

    def _landed_at(self, position: Position, superseded: list[Position] = ()) -> None:
        """`position` is in the store (holding the lock); `superseded` (older, never to be) are given up."""
        self.reached = max(self.reached or position, position)
        self._landed.add(position)
        self._live.discard(position)
        self._live.difference_update(superseded)
        self._cv.notify_all()

    def _run(self) -> None:
        while True:
            job, poll = None, False
            with self._cv:
                while True:
                    if self._stop or self.fenced is not None:
                        return
                    now = time.monotonic()
                    start = max(self._not_before, 0.0 if self._urgent else self._paced_until)
                    if self._next is not None and now >= start:
                        job, self._next = self._next, None
                        break
                    if self._pending and now >= self._poll_at:
                        poll = True
                        break
                    times = ([start] if self._next is not None else []) + ([self._poll_at] if self._pending else [])
                    self._cv.wait(max(min(times) - now, 0.001) if times else None)
            began, cpu = time.monotonic(), upload_cpu()
            try:
                if job is not None:
                    self._upload(job)
                    poll = self.is_chief
            except Exception as exc:  # noqa: BLE001 - a store failure (or any other): retried, training goes on
                self._failed(job, exc)
                continue
            try:
                if poll:
                    self._poll()
            except Exception as exc:  # noqa: BLE001 - the same, for the receipts, the commit and the pruning
                self._failed(None, exc)
            finally:
                if job is not None:
                    with self._cv:
                        self._paced_until = began + (upload_cpu() - cpu) / self.share

    def _upload(self, job: Job) -> None:
        commit.upload_files(self.store, job.name, job.local)
        if not self.is_chief:
            commit.write_receipt(self.store, job.name, self.attempt.generation, self.rank, job.local)
        shutil.rmtree(job.outbox, ignore_errors=True)  # (a retry after this point needs only names and sums)
        with self._cv:
            if self.is_chief:
                self._pending[job.name] = job
                for name in sorted(self._pending)[:-PENDING_MAX]:
                    self._live.discard(self._pending[name].position)   # given up: newer ones wait already
                    self._passed.add(self._pending.pop(name).position)
                self._poll_at, self._poll_every = 0.0, POLL_FIRST
            else:
                self._landed_at(job.position)
        self._healthy()

    def _poll(self) -> None:
        """The chief: commit the newest backup whose every part is in; else poll again later."""
        with self._cv:
            pending = sorted(self._pending.items(), reverse=True)
        for name, job in pending:
            if self.others and not set(self.others) <= commit.receipts(self.store, name):
                continue
            if self._fence():
                return
            commit.write_manifest(self.store, self.attempt, name, job.position, job.global_step, job.local,
                                  [self.rank] + self.others)
            with self._cv:
                older = [self._pending.pop(n).position for n in [n for n in self._pending if n <= name]]
                self._landed_at(job.position, older)
                busy = set(self._pending)
            # (the fence was checked just before the commit: the pruning right after it is covered by the same
            # check; a newer claim in between is the residual race `commit` describes)
            commit.prune(self.store, self.attempt.generation, self.keep, busy, cache=self._records)
            self._healthy()
            return
        with self._cv:
            self._poll_at = time.monotonic() + self._poll_every
            self._poll_every = min(self._poll_every * 1.5, POLL_MAX)
        self._healthy()

    def _fence(self) -> bool:
        """True (and one warning; this thread stops) when a newer attempt claimed this backup_dir."""
        newer = commit.newer_claim(self.store, self.attempt.generation)
        if newer is None:
            return False
        log.warning("%s=%r: attempt %d of this run started after this process's attempt %d (another copy of this "
                    "job runs: a retried Spark task, a pod that kept running, a restarted launch): this process "
                    "commits and deletes nothing more in the store; it trains on, and its backups stay local",
                    WHAT, self.store.shown, newer, self.attempt.generation)
        with self._cv:
            self.fenced = newer
            self._cv.notify_all()
        return True

    def _failed(self, job: Job | None, exc: BaseException) -> None:
        now = time.monotonic()
        reason = str(exc).splitlines()[0][:400] if str(exc) else type(exc).__name__
        with self._cv:
            first = self._failing is None
            if first:
                self._failing = now
            self._failure = reason
            self._hit |= self._live | self._passed
            delay = self._backoff
            self._backoff = min(self._backoff * 2, RETRY_MAX)
            if job is not None:
                self._not_before = now + delay
                if self._next is None and not self._stop:
                    self._next = job  # again, unless a newer backup came meanwhile
                else:
                    self._drop(job)
            else:
                self._poll_at = now + delay
        if first:
            committed = f"the newest committed backup is {self.reached}" if self.reached else \
                "no backup of this run is committed yet"
            log.warning("%s=%r: uploads are failing (%s). Training goes on and the uploads are retried with "
                        "backoff; %s, and a restart resumes there", WHAT, self.store.shown, reason, committed)

    def _healthy(self) -> None:
        with self._cv:
            since, self._failing = self._failing, None
            self._backoff = RETRY_FIRST
            self._passed.clear()
        if since is not None:
            log.warning("%s=%r: the store answers again after %.1f s; uploads go on (newest in the store: %s)",
                        WHAT, self.store.shown, time.monotonic() - since, self.reached)
