"""What a backup directory holds: the file names, checkpoint.json, and the position a backup stands at.

Layout (one directory per worker; the chief's is `backup_dir` itself):

    backup_dir/
      checkpoint.json                       names every backup kept, with each file's SHA-256
      epoch-00003.weights.h5                after 3 whole epochs: model + optimizer state
      epoch-00003.state.json                   and its step state, metrics, random and callbacks' state
      epoch-00003-step-0000004.weights.h5   after 3 epochs and 4 steps of the 4th (a step backup)
      epoch-00003-step-0000004.state.json
      epoch-00003-step-0000004.arrays.npz      callbacks' arrays (EarlyStopping's best weights), if any
      workers/worker-1/...                  each other worker's own copy, the same layout

A backup is named by its `Position`: `epoch` whole epochs done and `step`
steps of the next one. An epoch backup is the position (E, 0) and keeps the
name today's epoch backups have, so a directory written before step backups
existed (`epoch-N.weights.h5` and a checkpoint.json of `{"epoch", "sha256",
"epochs"}`, no state file) still resumes, at its epoch.

checkpoint.json (format 2):

    {"format": 2, "epoch": 3, "step": 4, "file": "epoch-00003-step-0000004.weights.h5", "sha256": "...",
     "backups": {"epoch-00003": {"epoch": 3, "step": 0, "files": {"epoch-00003.weights.h5": "<sha256>", ...}},
                 "epoch-00003-step-0000004": {...}}}

`epoch`/`file`/`sha256` name the newest backup, as format 1 did.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from stratkit import files
from stratkit.files import sha256  # noqa: F401 - what checkpoint.json and a store's manifest record

METADATA = "checkpoint.json"
WHAT = "backup_dir"
_STEM = re.compile(r"^epoch-(?P<epoch>\d{5,})(-step-(?P<step>\d{7,}))?$")
_FILE = re.compile(r"^(?P<stem>epoch-\d{5,}(-step-\d{7,})?)\.(?P<part>weights\.h5|state\.json|arrays\.npz)$")
WEIGHTS, STATE, ARRAYS = "weights.h5", "state.json", "arrays.npz"
#: Positions are compared as one int (MIN over workers): epoch * STEP_LIMIT + step.
STEP_LIMIT = 10 ** 9


@dataclass(frozen=True, order=True)
class Position:
    """Where a backup stands: `epoch` whole epochs done, then `step` steps of epoch index `epoch`."""

    epoch: int = 0
    step: int = 0

    @property
    def stem(self) -> str:
        return f"epoch-{self.epoch:05d}" if self.step == 0 else f"epoch-{self.epoch:05d}-step-{self.step:07d}"

    @property
    def key(self) -> int:
        """One int that orders positions (what the workers MIN over)."""
        return self.epoch * STEP_LIMIT + self.step

    @classmethod
    def from_key(cls, key: int) -> "Position":
        return cls(int(key) // STEP_LIMIT, int(key) % STEP_LIMIT)

    def __str__(self) -> str:
        return f"epoch {self.epoch}" if self.step == 0 else f"epoch {self.epoch} + {self.step} steps"


def position_of(name: str) -> tuple[Position, str] | None:
    """(position, part) of a backup file's name ("weights.h5", "state.json", "arrays.npz"), else None."""
    match = _FILE.match(name)
    if not match:
        return None
    stem = _STEM.match(match["stem"])
    assert stem is not None
    return Position(int(stem["epoch"]), int(stem["step"] or 0)), match["part"]


def file_name(position: Position, part: str) -> str:
    return f"{position.stem}.{part}"


def worker_backup_dir(backup_dir: str, is_chief: bool, rank: int) -> str:
    """The chief writes to backup_dir itself; every other worker to its own subdirectory."""
    return backup_dir if is_chief else os.path.join(backup_dir, "workers", f"worker-{rank}")


def on_disk(directory: str) -> dict[Position, set[str]]:
    """Every backup position with files in `directory`, and the parts it has (temporaries never match)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    found: dict[Position, set[str]] = {}
    for name in names:
        parsed = position_of(name)
        if parsed is not None:
            found.setdefault(parsed[0], set()).add(parsed[1])
    return found


@dataclass
class Metadata:
    """What checkpoint.json says: `state` is "ok", "missing" or "corrupt" (then `problem` says why).

    `backups` maps each position it names to {file name: SHA-256, or None where format 1 kept none}.
    """

    state: str
    backups: dict[Position, dict[str, str | None]] = field(default_factory=dict)
    problem: str = ""

    @property
    def latest(self) -> Position | None:
        return max(self.backups) if self.backups else None

    @property
    def epoch(self) -> int:
        """The newest position's whole epochs (format 1's only number)."""
        latest = self.latest
        return latest.epoch if latest is not None else 0

    @property
    def digests(self) -> dict[int, str | None]:
        """Epoch backups' weights checksums by epoch (what format 1 called `epochs`)."""
        return {p.epoch: names.get(file_name(p, WEIGHTS)) for p, names in self.backups.items() if p.step == 0}


def read_metadata(directory: str) -> Metadata:
    path = os.path.join(directory, METADATA)
    try:
        raw = files.read_bytes(path, f"{WHAT}={directory!r}")
    except FileNotFoundError:
        return Metadata("missing")
    except OSError as exc:
        return Metadata("corrupt", problem=f"cannot be read: {exc.strerror or exc}")
    try:
        value = json.loads(raw.decode("utf-8"))
        backups = _format2(value) if "backups" in value else _format1(value)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Metadata("corrupt", problem=f"is not valid ({type(exc).__name__}: {str(exc)[:80]})")
    bad = [p for p in backups if p.epoch < 0 or p.step < 0 or p == Position()]
    if bad or not backups:
        return Metadata("corrupt", problem=f"names {bad[0] if bad else 'no backup'}")
    return Metadata("ok", backups)


def _format1(value: dict) -> dict[Position, dict[str, str | None]]:
    """`{"epoch": N, "sha256": ..., "epochs": {"N": sha}}`: epoch backups, weights files only."""
    epoch = int(value["epoch"])
    digests: dict[int, str | None] = {int(k): str(v) for k, v in dict(value.get("epochs") or {}).items()}
    digests.setdefault(epoch, value.get("sha256"))  # files written before checksums were kept: None
    if epoch < 1 or any(e < 1 for e in digests):
        raise ValueError(f"epoch {epoch}")
    return {Position(e): {file_name(Position(e), WEIGHTS): d} for e, d in digests.items() if e <= epoch}


def _format2(value: dict) -> dict[Position, dict[str, str | None]]:
    backups = {}
    for stem, entry in dict(value["backups"]).items():
        position = Position(int(entry["epoch"]), int(entry["step"]))
        if position.stem != stem:
            raise ValueError(f"{stem} names {position}")
        names = {str(k): (str(v) if v else None) for k, v in dict(entry["files"]).items()}
        if file_name(position, WEIGHTS) not in names or any(position_of(n) != (position, n.split(".", 1)[1])
                                                             for n in names):
            raise ValueError(f"{stem} names files {sorted(names)}")
        backups[position] = names
    return backups


def write_metadata(directory: str, backups: dict[Position, dict[str, str]]) -> None:
    """Replace checkpoint.json atomically with one naming `backups` (format 2; the newest also as format 1 did)."""
    latest = max(backups)
    weights = file_name(latest, WEIGHTS)
    body = {"format": 2, "epoch": latest.epoch, "step": latest.step, "file": weights,
            "sha256": backups[latest][weights],
            "backups": {p.stem: {"epoch": p.epoch, "step": p.step, "files": dict(sorted(names.items()))}
                        for p, names in sorted(backups.items())}}
    files.write_bytes(os.path.join(directory, METADATA), json.dumps(body, indent=1).encode())
