"""A search's files on a store URL or a directory: its state, each trial's files per run, its backups.

Layout under the search's store (``s3://bucket/search``, ``gs://...``, ``az://...``
or a directory, through `stratkit.storage`: whole-object writes only):

    search.json                 the service's state: the planner's, the leases' history, which run ended each
                                trial; one object, replaced whole at every change (a reader sees the old
                                state or the new one, never half of one), so a restarted service resumes
                                where the last write left it and never runs a finished trial again
    handshake.json              a nonce the service writes at start; a tuner that cannot read it does not
                                see this store (a local path that is not shared between machines)
    trials/<id>/run-<r>/...     the files run r of a trial made (a KerasTuner checkpoint and build config);
                                the run that ended the trial is the trial's (search.json names it)
    trials/<id>/backup/         the trial's backups (`stratkit.callbacks.Backup`): a run that takes over a
                                lost trial resumes at its last epoch

No shared file system is needed: every tuner reads and writes only through the
store, and its own working directory is private.

Imports no TensorFlow.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.storage import Store

STATE = "search.json"
HANDSHAKE = "handshake.json"
TRIALS = "trials"


class SearchStore:
    """The store a search keeps its state and trial files in (`path`: a store URL or a local directory)."""

    def __init__(self, path: str | os.PathLike[str], what: str = "store") -> None:
        text = os.fspath(path)
        local = storage.local_path(text, what)
        self.path = os.path.abspath(local) if local is not None else text.rstrip("/")
        self.what = what
        self._store: Store | None = None

    def __repr__(self) -> str:
        return f"SearchStore({storage.redact(self.path)!r})"

    @property
    def shown(self) -> str:
        return storage.redact(self.path)

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = storage.open_store(self.path, self.what)
        return self._store

    @property
    def local(self) -> bool:
        return not storage.is_url(self.path)

    def check(self) -> None:
        """Prove the store answers and takes writes (`storage.check_store`), before any trial runs.

        Raises:
            ConfigError: naming the store, the problem and the fix.
        """
        if self.local:
            try:
                os.makedirs(self.path, exist_ok=True)
                probe = os.path.join(self.path, f"{storage.PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
                with open(probe, "wb"):
                    pass
                os.remove(probe)
            except OSError as exc:
                raise ConfigError(f"{self.what}={self.path!r} cannot be written ({exc.strerror or exc}). Fix: a "
                                  "directory this user may write, or a store URL (s3://, gs://, az://)") from None
            self._store = storage.open_store(self.path, self.what)
            return
        self._store = storage.check_store(self.path, self.what)

    # -- the service's state ------------------------------------------------------------------------
    def read_state(self) -> dict[str, Any] | None:
        """The stored state, or None when this store holds no search yet."""
        try:
            data = self.store.read_bytes(STATE)
        except FileNotFoundError:
            return None
        try:
            state = json.loads(data)
        except ValueError as exc:
            raise ConfigError(f"{self.what}={self.shown!r}: {STATE} is not JSON ({exc}). Fix: move the store away "
                              "to start the search over") from None
        return state if isinstance(state, dict) else None

    def write_state(self, state: dict[str, Any]) -> None:
        self.store.write_bytes(STATE, json.dumps(state, separators=(",", ":")).encode())

    def write_handshake(self) -> str:
        """A fresh nonce, written for the tuners to read back (`check_handshake`)."""
        nonce = secrets.token_hex(8)
        self.store.write_bytes(HANDSHAKE, json.dumps({"nonce": nonce}).encode())
        return nonce

    def check_handshake(self, nonce: str, who: str) -> None:
        """Raise a ConfigError when this process does not see the nonce the service wrote: another store."""
        try:
            seen = json.loads(self.store.read_bytes(HANDSHAKE)).get("nonce")
        except (FileNotFoundError, ValueError, AttributeError):
            seen = None
        if seen != nonce:
            raise ConfigError(f"{who} does not see the search's files at {self.what}={self.shown!r}: the service "
                              f"wrote {HANDSHAKE} there, and this process "
                              + ("finds another one" if seen else "finds none")
                              + ". A local path is a different directory on each machine. Fix: give the search a "
                              "store every tuner reaches (s3://, gs://, az://, or a shared file system)")

    # -- trial files ------------------------------------------------------------------------------
    def run_prefix(self, trial_id: str, run: int) -> str:
        return f"{TRIALS}/{trial_id}/run-{int(run)}"

    def backup_path(self, trial_id: str, execution: int = 0) -> str:
        """Where a trial's backups go (its runs share them: a new run resumes the last one's)."""
        name = f"{TRIALS}/{trial_id}/backup" + (f"/execution-{execution}" if execution else "")
        return os.path.join(self.path, *name.split("/")) if self.local else storage.join(self.path, name)

    def upload(self, trial_id: str, run: int, local_file: str) -> None:
        """Put one of a run's files (named as the local file) on the store, whole."""
        self.store.upload(local_file, f"{self.run_prefix(trial_id, run)}/{os.path.basename(local_file)}")

    def download(self, trial_id: str, run: int, local_dir: str) -> list[str]:
        """Copy a run's files into `local_dir` (each replaced whole); the names copied."""
        return self.store.download_dir(self.run_prefix(trial_id, run), local_dir)

    def runs_with_files(self, trial_id: str) -> list[int]:
        """The runs of a trial that left files, oldest first."""
        runs = set()
        for name in self.store.list(f"{TRIALS}/{trial_id}"):
            part = name.split("/")[2] if name.count("/") >= 3 else ""
            if part.startswith("run-") and part[4:].isdigit():
                runs.add(int(part[4:]))
        return sorted(runs)

    def remove_runs(self, trial_id: str, keep: int) -> None:
        """Delete the files of a trial's runs other than `keep` (the run that ended it)."""
        for run in self.runs_with_files(trial_id):
            if run != keep:
                self.store.remove_all(self.run_prefix(trial_id, run))


__all__ = ["HANDSHAKE", "STATE", "SearchStore"]
