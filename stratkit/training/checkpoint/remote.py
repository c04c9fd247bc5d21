"""`backup_dir` on an object store (``s3://``, ``gs://``, ``az://``/``abfs://``, ``hdfs://``): what `Backup` does.

Each worker writes its backups exactly as to a local `backup_dir` (the
replica check, then every file atomically with its checksum in
checkpoint.json), into its own local **staging directory**, so a backup costs
training the local write it costs with a local `backup_dir`; `uploads`
carries it to the store beside training and `commit` makes it a backup a
resume can take.

The staging directory is ``<root>/<run>/worker-<rank>``: the root is
STRATKIT_BACKUP_STAGING if set, else ``stratkit-backups-<uid>`` in the system
temporary directory (TMPDIR, else /tmp); <run> names the URL (its last part
and a hash). The temporary directory, not ``~/.cache``: on clusters a home
directory is often one network file system every node shares (its speed and
quota are not a local disk's, and two attempts' workers of one rank would
write one directory), while TMPDIR is the machine's own (Slurm and
Kubernetes point it at node-local scratch). Staging only has to outlive its
upload: a restart on the same host reuses what is still there (checked
against the manifest: nothing is trusted unchecked), a fresh host downloads.
A process finding its directory locked by a live process of the same rank (a
leftover on the same host) stages in a directory of its own.

At the start of `fit` (`decide`, before step 1), with one collective per
step below (every worker calls them, so a failure on one never hangs the others):

1. every worker checks the store (`stratkit.storage.check_store`: a missing
   bucket, refused or missing credentials, a store that does not answer are a
   `ConfigError`);
2. the chief claims this attempt's generation, reads the newest committed
   backup of the lineage whose files verify into its staging directory, and
   records it as the attempt's base; every worker learns the generation and
   the base from the chief;
3. every other worker reads its files of that backup (its own state, or the
   chief's where it has none: a new worker, another world size) and checks
   them; all go on only if every worker could.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stratkit import files, status
from stratkit.errors import ConfigError
from stratkit.storage import Store, check_store, open_store, redact
from stratkit.training.checkpoint import commit, readback
from stratkit.training.checkpoint.layout import WEIGHTS, WHAT, Position, on_disk, write_metadata
from stratkit.training.checkpoint.store import ResumePoint, prepare_dir, remove_backup
from stratkit.training.checkpoint.uploads import Report, Uploads

log = status.logger(__name__)

STAGING_VAR = "STRATKIT_BACKUP_STAGING"
#: Seconds after a preemption notice the exit waits at most for the final backup to be in the store.
WAIT_VAR = "STRATKIT_BACKUP_UPLOAD_WAIT"
DEFAULT_WAIT = 20.0
#: Seconds a `fit` that raised waits for its newest backup to reach the store before it gives up.
FLUSH_AFTER_ERROR = 10.0
#: What a worker proposes to a MIN when only the chief's value counts (a broadcast through the MIN).
_OTHERS = 2 ** 62


def staging_root() -> str:
    """Where this host's workers stage their backups (STRATKIT_BACKUP_STAGING, else the temporary directory)."""
    configured = os.environ.get(STAGING_VAR, "").strip()
    return configured or os.path.join(tempfile.gettempdir(), f"stratkit-backups-{os.geteuid()}")


def run_key(url: str) -> str:
    """The staging name of the run at `url`: its last part and a hash of the whole (never a secret)."""
    shown = redact(url).rstrip("/")
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", shown.rsplit("/", 1)[-1])[:40] or "run"
    return f"{tail}-{hashlib.sha256(shown.encode()).hexdigest()[:12]}"


def wait_seconds() -> float:
    raw = os.environ.get(WAIT_VAR, "").strip()
    try:
        return float(raw) if raw else DEFAULT_WAIT
    except ValueError:
        raise ConfigError(f"{WAIT_VAR}={raw!r} is not a number of seconds. Fix: e.g. {WAIT_VAR}=20 (how long a "
                          "preempted run waits for its final backup to reach the store)") from None


def _store_error(store: Store | None, exc: BaseException) -> ConfigError:
    if isinstance(exc, ConfigError):
        return exc
    shown = store.shown if store is not None else "?"
    return ConfigError(f"{WHAT}={shown!r}: {exc}. Fix: check the store and its credentials, and that every "
                       "machine of the cluster reaches it")


def point_from(chosen: readback.Chosen, rank: int, directory: str, url: str) -> ResumePoint:
    """The `ResumePoint` of a backup read back into `directory` for worker `rank` (checkpoint.json names it)."""
    manifest = chosen.manifest
    position = manifest["position"]
    digests = {rel.rsplit("/", 1)[-1]: digest for rel, (digest, _) in readback.needed(manifest, rank).items()}
    write_metadata(directory, {position: {os.path.basename(p): digests[os.path.basename(p)]
                                          for p in chosen.paths.values()}})
    return ResumePoint(position.epoch, chosen.paths[WEIGHTS], checked=True, step=position.step,
                       files=dict(chosen.paths), source=f"{redact(url).rstrip('/')}/{commit.BACKUPS}/{chosen.name}")


def read_back(url: str, target: str, rank: int = 0) -> ResumePoint:
    """The newest committed backup at `url` whose files verify, read into the local directory `target`, as a
    `ResumePoint` (position (0, 0): there is none). Worker `rank`'s files: the weights and its state.

    Raises:
        ConfigError: committed backups exist and none can be used; the store cannot be read.
    """
    store = open_store(url, WHAT)
    try:
        chosen, skipped = readback.newest_verified(store, rank, target)
    except OSError as exc:
        raise _store_error(store, exc) from None
    if chosen is None:
        return ResumePoint(note=f"{WHAT}={store.shown!r} holds no committed backup, only {'; '.join(skipped)}"
                           if skipped else None)
    point = point_from(chosen, rank, target, url)
    if skipped:
        point.note = f"{WHAT}={store.shown!r}: skipped {'; '.join(skipped)}; resuming from {chosen.name}"
    return point


class RemoteBackups:
    """One worker's side of a `backup_dir` URL: its staging directory, the start, the uploads, the end.

    Args:
        url: `backup_dir`.
        rank: this worker's rank (its part of each backup).
        is_chief: this worker claims the attempt, commits and prunes.
        keep: committed backups kept in the store.
        staging: the staging root (default: `staging_root()`).
    """

    def __init__(self, url: str, *, rank: int, is_chief: bool, keep: int, staging: str | None = None) -> None:
        self.url, self.rank, self.is_chief, self.keep = url, int(rank), bool(is_chief), keep
        self.root = os.path.join(os.fspath(staging) if staging else staging_root(), run_key(url))
        self.store: Store | None = None
        self.attempt: commit.Attempt | None = None
        self.uploads: Uploads | None = None
        self._directory: str | None = None
        self._lock: Any = None
        self._records: dict[int, commit.Attempt] = {}

    @property
    def shown(self) -> str:
        return redact(self.url)

    # -- the staging directory ----------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """This worker's staging directory (a local backup directory: the layout of `layout`)."""
        if self._directory is None:
            files.check_dir(self.root, STAGING_VAR)
            for name in (commit.part(self.rank), f"{commit.part(self.rank)}-{os.getpid()}"):
                directory = os.path.join(self.root, name)
                files.check_file(directory + ".lock", STAGING_VAR)
                handle = open(directory + ".lock", "a+")  # noqa: SIM115 - held until the run ends
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                self._lock, self._directory = handle, directory
                break
            else:
                raise ConfigError(f"{STAGING_VAR}: {self.root!r} is in use by other processes of rank {self.rank}")
            files.check_dir(self._directory, STAGING_VAR)
        return self._directory

    # -- the start ------------------------------------------------------------------------------
    def decide(self, agree: Callable[[int], int], workers: int) -> tuple[Position, Any, Any]:
        """Claim this attempt, choose and read back the backup it resumes from (see the module docstring).

        `agree` is the MIN over every worker (a collective; identity on one). Returns (position, the resume
        point or None, the point whose note to show).

        Raises:
            ConfigError: on every worker, when any of them cannot reach the store or read the backup.
        """
        error: ConfigError | None = None
        try:
            self.store = check_store(self.url, WHAT)
            prepare_dir(self.directory)
        except ConfigError as exc:
            error = exc
        self._together(agree, error, "could not reach it")
        chosen, skipped = None, []
        if self.is_chief:
            try:
                self.attempt = commit.claim(self.store, workers)
                chosen, skipped = readback.newest_verified(self.store, self.rank, self.directory, self._records,
                                                         top=self.attempt.generation)
                commit.set_base(self.store, self.attempt, chosen.name if chosen else None)
            except (ConfigError, OSError) as exc:
                error = _store_error(self.store, exc)
        generation = self._from_chief(agree, self.attempt.generation if error is None and self.attempt else -1)
        if generation < 0:
            raise error or ConfigError(f"{WHAT}={self.shown!r}: the chief could not start this run's attempt on the "
                                       "store (its log says why). Fix: see the chief's error")
        parsed = commit.parse_name(chosen.name) if chosen else None
        base_generation = self._from_chief(agree, parsed[0] if parsed else 0)
        base_key = self._from_chief(agree, parsed[1].key if parsed else 0)
        if not self.is_chief:
            self.attempt = commit.Attempt(generation)
        point, problem = None, None
        if base_generation:
            name = commit.backup_name(base_generation, Position.from_key(base_key))
            try:
                if chosen is None:
                    manifest = readback.read_manifest(self.store, name)
                    chosen = readback.Chosen(name, manifest, readback.materialize(self.store, name, manifest, self.rank,
                                                                               self.directory))
                point = point_from(chosen, self.rank, self.directory, self.url)
            except (ValueError, OSError) as exc:
                problem = f"{name}: {exc}"
        elif on_disk(self.directory):
            remove_backup(self.directory)  # an earlier run's local files: nothing in the store names them
        if agree(base_key if problem is None else -1) != base_key:
            raise ConfigError(f"{WHAT}={self.shown!r}: " + (
                f"this worker could not read the backup the run resumes from: {problem}" if problem else
                "another worker could not read the backup the run resumes from (its log says why)") +
                ". Nothing was changed. Fix: check that every machine reaches the store with the same credentials")
        position = Position.from_key(base_key) if base_generation else Position()
        note = None
        if point is not None and skipped:
            note = point.note = (f"{WHAT}={self.shown!r}: skipped {'; '.join(skipped)}; resuming from {position} "
                                 f"({chosen.name}) instead")
        elif skipped:
            note = (f"{WHAT}={self.shown!r} holds no committed backup, only {'; '.join(skipped)}: starting from "
                    "the beginning")
        self.uploads = Uploads(self.store, self.attempt, rank=self.rank, is_chief=self.is_chief,
                               ranks=list(range(max(int(workers), 1))), keep=self.keep,
                               outbox=self.directory + ".outbox", reached=position if point is not None else None)
        return position, point, point if point is not None else ResumePoint(note=note)

    def _from_chief(self, agree: Callable[[int], int], value: int) -> int:
        """The chief's `value` on every worker (a MIN where every other worker proposes more)."""
        return int(agree(value if self.is_chief else _OTHERS))

    def _together(self, agree: Callable[[int], int], error: ConfigError | None, what: str) -> None:
        """Every worker raises when any failed (the failing one its own error): none waits in a collective alone."""
        if int(agree(0 if error is not None else 1)) == 0:
            raise error or ConfigError(f"{WHAT}={self.shown!r}: another worker {what} (its log says why). Fix: "
                                       "give every machine of the cluster the store's endpoint and credentials")

    # -- during training --------------------------------------------------------------------------
    def submit(self, position: Position, global_step: int) -> None:
        if self.uploads is not None:
            self.uploads.submit(position, global_step, self.directory)

    def final(self, position: Position, noticed_at: float | None) -> str:
        """Wait for the preemption backup at `position` to be in the store; what to say about it."""
        if self.uploads is None:
            return ""
        limit = wait_seconds()
        started = time.monotonic()
        remaining = (noticed_at if noticed_at else started) + limit - started
        what = "committed to the store" if self.is_chief else "this worker's part is in the store"
        if self.uploads.wait(position, remaining):
            return f"{what} in {time.monotonic() - started:.2f} s"
        why = self.uploads.failing or "the upload was still under way"
        fenced = self.uploads.fenced
        if fenced is not None:
            why = f"attempt {fenced} of this run started since, so this process commits nothing"
        newest = self.uploads.reached
        return (f"NOT in the store {limit:g} s after the notice ({why}; {WAIT_VAR} sets how long the exit "
                f"waits): a restart resumes from {newest if newest else 'the start'}, the newest backup in the store")

    # -- the end ---------------------------------------------------------------------------------
    def close(self, flush: float = 0.0) -> None:
        """Stop the uploads (first waiting up to `flush` s for the newest), and say what never reached the store."""
        uploads, self.uploads = self.uploads, None
        if uploads is None:
            return
        report = uploads.close(flush)
        if report.lost:
            _say_lost(self.shown, report)

    def remove(self) -> None:
        """The run finished: the chief removes its backups from the store (unless a newer attempt owns them)."""
        if not self.is_chief or self.store is None or self.attempt is None:
            return
        try:
            newer = commit.newer_claim(self.store, self.attempt.generation)
            if newer is not None:
                log.warning("%s=%r: attempt %d of this run started after this one (%d), which finished: its "
                            "backups are left to it", WHAT, self.shown, newer, self.attempt.generation)
                return
            commit.remove_all(self.store, self.attempt.generation)
        except OSError as exc:
            log.warning("%s=%r: could not remove the finished run's backups from the store (%s); they stay, and a "
                        "later fit with this backup_dir resumes from them: remove them to start over", WHAT,
                        self.shown, exc)

    def remove_local(self) -> None:
        """Remove this worker's staging directory (and release it)."""
        if self._directory is None:
            return
        shutil.rmtree(self._directory, ignore_errors=True)
        shutil.rmtree(self._directory + ".outbox", ignore_errors=True)
        files.remove(self._directory + ".lock")
        if self._lock is not None:
            self._lock.close()
        self._directory, self._lock = None, None
        try:
            os.rmdir(self.root)
        except OSError:
            pass


def _say_lost(shown: str, report: Report) -> None:
    listed = ", ".join(str(p) for p in report.lost[:6]) + (f" and {len(report.lost) - 6} more"
                                                           if len(report.lost) > 6 else "")
    newest = f"the newest in the store is {report.reached}" if report.reached else "none of this run is in the store"
    log.warning("%s=%r: %d backup(s) never reached the store (%s): %s; %s", WHAT, shown, len(report.lost), listed,
                report.failure or "the store failed", newest)
