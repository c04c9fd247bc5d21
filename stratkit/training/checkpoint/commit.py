"""Backups on an object store: the commit, the attempt fence, and reading the newest committed backup back.

An object store has whole objects and no rename (on S3 a rename is a copy),
so a backup of several files commits by writing one object last that names
the others. With `backup_dir` a URL (``s3://bucket/run``) the store holds:

    attempts/00000003.json        attempt 3's claim: {"generation", "attempt" (random id), "started", ...}
    attempts/00000003.base.json   the committed backup attempt 3 resumed from ({"base": name or null})
    backups/00000003-epoch-00002-step-0000001/          one immutable prefix per backup
        epoch-00002-step-0000001.weights.h5             the weights, once (from the chief)
        worker-0/epoch-00002-step-0000001.state.json    each worker's own state (and arrays.npz)
        worker-1/epoch-00002-step-0000001.state.json
        receipts/worker-1.json                          each other worker's files, written after them
        manifest.json                                   the commit: every file with its SHA-256 and size

**The commit.** Each worker uploads its part of a backup (`upload_files`):
the chief the weights file and its own state, every other worker its own
state and arrays (the replica check before every backup guarantees identical
weights, so they are uploaded once; a worker's own state lets the same world
resume each worker as it was, and a worker new to the world, or one whose
part is missing, takes the chief's state as it does from a local backup).
A worker writes its receipt (its files' checksums) after its files. The
chief polls the backup's receipts (one LIST each poll, backing off from 20
ms to 1 s) and, once every worker's receipt is in, writes the manifest: that
is the commit. Receipts in the store rather than TensorFlow's coordination
service: they work on every engine and world size (Spark, Ray Train, one
process), need no private TensorFlow API, survive a restarted process, and
an upload already sits on the store's consistency (S3, GCS and Azure are
strongly read-after-write consistent, so a receipt seen means its objects are
readable). A reader takes only prefixes with a manifest, downloads the files
it needs to a local directory (a private temporary then a rename) and checks
each one's size and SHA-256 before anything reads it: a backup killed mid-
upload has no manifest, and a damaged file sends the reader to the next older
commit. Nothing half-written is ever read.

**The attempt fence.** Every `fit` is an attempt: at its start the chief
claims the next generation with an exclusive create of
``attempts/<generation>.json`` (S3 ``If-None-Match``, GCS
``ifGenerationMatch=0``, Azure ``overwrite=False``; read back where an
emulator ignores it), chooses the newest committed backup of the lineage
whose files verify, and records it as its base. The lineage of the newest
attempt is what readers trust: its own commits, then, from the attempt its
base belongs to, the commits up to and including that base, and so on back.
Writers check they are current (no newer claim) before every commit and
every deletion, and delete only backups of their own or older generations.
The guarantee:

* a process of an earlier attempt (a Spark task retried elsewhere, a pod that
  kept running) never has a commit read by a later attempt unless the later
  attempt chose it: a commit it makes after the later attempt chose its base
  is newer than that base and outside the lineage, race or no race;
* it never deletes anything of a later attempt (deletions are limited to its
  own and older generations), and after it has seen the later claim it
  deletes and commits nothing.

The residual race: a check and the deletion after it are not one atomic
step, so one deletion begun before the later claim can still run after it.
It removes only the earlier attempt's own commits older than its newest
`keep` (and older generations'); the later attempt's base is one of those only
if the earlier attempt's newest `keep` commits all failed to verify. The
later attempt then fails to download it and says so (nothing wrong is read).

Pure store and file work: no TensorFlow, no threads (`uploads` runs these
beside training; `remote` ties them to `Backup`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from stratkit.errors import ConfigError
from stratkit.storage import Store
from stratkit.training.checkpoint.layout import WEIGHTS, WHAT, Position

ATTEMPTS, BACKUPS = "attempts", "backups"
MANIFEST, RECEIPTS = "manifest.json", "receipts"
FORMAT = 1
_NAME = re.compile(r"^(?P<generation>\d{8})-epoch-(?P<epoch>\d{5,})(-step-(?P<step>\d{7,}))?$")
_RECORD = re.compile(r"^attempts/(?P<generation>\d{8})(?P<base>\.base)?\.json$")
#: How many times a chief tries to claim a generation others keep taking first.
_CLAIMS = 20


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def backup_name(generation: int, position: Position) -> str:
    """The prefix name of the backup at `position` written by attempt `generation` (sorts by both)."""
    return f"{generation:08d}-{position.stem}"


def parse_name(name: str) -> tuple[int, Position] | None:
    """(generation, position) of a backup's prefix name, None for any other name."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match["generation"]), Position(int(match["epoch"]), int(match["step"] or 0))


def part(rank: int) -> str:
    return f"worker-{int(rank)}"


def path_of(*parts: str) -> str:
    """A store name from its parts ("backups", name, file)."""
    return "/".join(p.strip("/") for p in parts if p)


@dataclass
class Attempt:
    """One attempt's records: its generation, random id, and its base (`known_base` False: not chosen yet)."""

    generation: int
    attempt: str = ""
    base: str | None = None
    known_base: bool = False


@dataclass
class Listing:
    """What one LIST of the store's root shows: attempt records and each backup prefix's objects."""

    records: dict[int, set[str]] = field(default_factory=dict)
    backups: dict[str, set[str]] = field(default_factory=dict)

    @property
    def committed(self) -> list[str]:
        return sorted(name for name, names in self.backups.items() if MANIFEST in names)


def scan(store: Store) -> Listing:
    """Everything stratkit keeps in the store (one recursive LIST; never cached)."""
    listing = Listing()
    for key in store.list():
        record = _RECORD.match(key)
        if record is not None:
            listing.records.setdefault(int(record["generation"]), set()).add("base" if record["base"] else "claim")
            continue
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == BACKUPS and parse_name(parts[1]) is not None:
            listing.backups.setdefault(parts[1], set()).add(parts[2])
    return listing


# --------------------------------------------------------------------------------------------
# Attempts and the lineage
# --------------------------------------------------------------------------------------------


def _record_name(generation: int, base: bool = False) -> str:
    return path_of(ATTEMPTS, f"{generation:08d}{'.base' if base else ''}.json")


def read_attempts(store: Store, listing: Listing, cache: dict[int, Attempt] | None = None) -> dict[int, Attempt]:
    """Every attempt the listing shows, with its base where it was recorded (records never change: cached)."""
    cache = {} if cache is None else cache
    out = {}
    for generation, kinds in sorted(listing.records.items()):
        known = cache.get(generation)
        if known is None or (not known.known_base and "base" in kinds):
            known = Attempt(generation)
            try:
                if "claim" in kinds:
                    known.attempt = str(json.loads(store.read_bytes(_record_name(generation)))["attempt"])
                if "base" in kinds:
                    known.base = json.loads(store.read_bytes(_record_name(generation, True)))["base"]
                    known.known_base = True
            except FileNotFoundError:
                continue  # removed between the LIST and the read: a finished run's removal
            except (ValueError, KeyError, TypeError):
                known.known_base = False  # an unreadable record names nothing
            cache[generation] = known
        out[generation] = known
    return out


def lineage(attempts: dict[int, Attempt], committed: list[str], top: int | None = None) -> list[str]:
    """The committed backups the newest attempt (or `top`) trusts, newest first (see the module docstring).

    An attempt without a recorded base (it is choosing one now, or it died first) committed nothing; the
    walk goes on to the attempt before it, trusting all of that one's commits.
    """
    parsed = {name: parse_name(name) for name in committed}
    generations = sorted((g for g in attempts if top is None or g <= top), reverse=True)
    trusted: list[str] = []
    current = generations[0] if generations else None
    upper: tuple[int, Position] | None = None
    while current is not None:
        own = sorted((n for n, p in parsed.items() if p and p[0] == current and (upper is None or p <= upper)),
                     reverse=True)
        trusted += own
        record = attempts.get(current)
        if record is None or not record.known_base:
            older = [g for g in generations if g < current]
            current, upper = (older[0] if older else None), None
            continue
        base = parse_name(record.base) if record.base else None
        if base is None or base[0] >= current:
            break  # started from scratch: nothing older is trusted
        current, upper = base[0], base
    return trusted


def claim(store: Store, workers: int) -> Attempt:
    """Claim the next generation for this attempt (an exclusive create); its record, base not chosen yet."""
    for _ in range(_CLAIMS):
        generation = max(scan_records(store), default=0) + 1
        attempt = os.urandom(8).hex()
        body = json.dumps({"format": FORMAT, "generation": generation, "attempt": attempt, "started": time.time(),
                           "host": socket.gethostname(), "pid": os.getpid(), "workers": workers}).encode()
        if store.create_bytes(_record_name(generation), body):
            return Attempt(generation, attempt)
    raise ConfigError(f"{WHAT}={store.shown!r}: could not claim an attempt generation in {_CLAIMS} tries (other "
                      "processes keep starting runs on this backup_dir). Fix: run one job per backup_dir")


def scan_records(store: Store) -> list[int]:
    """The generations with a claim (one LIST of attempts/)."""
    found = set()
    for key in store.list(ATTEMPTS):
        match = _RECORD.match(key)
        if match is not None and not match["base"]:
            found.add(int(match["generation"]))
    return sorted(found)


def set_base(store: Store, attempt: Attempt, base: str | None) -> None:
    """Record the backup `attempt` resumed from (None: from scratch); written once, before any commit."""
    store.write_bytes(_record_name(attempt.generation, True),
                      json.dumps({"attempt": attempt.attempt, "base": base}).encode())
    attempt.base, attempt.known_base = base, True


def newer_claim(store: Store, generation: int) -> int | None:
    """The newest generation if it is newer than `generation` (this writer is fenced), else None."""
    newest = max(scan_records(store), default=generation)
    return newest if newest > generation else None


# --------------------------------------------------------------------------------------------
# Writing: parts, receipts, the manifest
# --------------------------------------------------------------------------------------------


@dataclass
class LocalFile:
    """A file of a backup on its way to the store: where it is, its name in the backup, SHA-256 and size."""

    path: str
    name: str
    sha256: str
    size: int


def upload_files(store: Store, name: str, local: list[LocalFile]) -> None:
    for item in local:
        store.upload(item.path, path_of(BACKUPS, name, item.name))


def _described(local: list[LocalFile]) -> dict[str, dict[str, Any]]:
    return {item.name: {"sha256": item.sha256, "size": item.size} for item in local}


def write_receipt(store: Store, name: str, generation: int, rank: int, local: list[LocalFile]) -> None:
    """A worker's part of `name` is in: its files' checksums (written after the files themselves)."""
    body = {"generation": generation, "rank": rank, "files": _described(local)}
    store.write_bytes(path_of(BACKUPS, name, RECEIPTS, f"{part(rank)}.json"), json.dumps(body).encode())


def receipts(store: Store, name: str) -> set[int]:
    """The ranks whose receipt for `name` is in (one LIST)."""
    found = set()
    for key in store.list(path_of(BACKUPS, name, RECEIPTS)):
        stem = key.rsplit("/", 1)[-1]
        if stem.startswith("worker-") and stem.endswith(".json") and stem[7:-5].isdigit():
            found.add(int(stem[7:-5]))
    return found


def write_manifest(store: Store, attempt: Attempt, name: str, position: Position, global_step: int,
                   chief: list[LocalFile], ranks: list[int]) -> None:
    """The commit: every worker's files (from its receipt) and the chief's, with checksums; written last."""
    described = _described(chief)
    for rank in ranks:
        if rank != 0:
            receipt = json.loads(store.read_bytes(path_of(BACKUPS, name, RECEIPTS, f"{part(rank)}.json")))
            described.update({str(k): dict(v) for k, v in dict(receipt["files"]).items()})
    weights = next(item.name for item in chief if item.name.endswith(WEIGHTS))
    body = {"format": FORMAT, "generation": attempt.generation, "attempt": attempt.attempt,
            "epoch": position.epoch, "step": position.step, "global_step": global_step, "weights": weights,
            "workers": sorted(ranks), "chief": 0, "time": time.time(), "files": described}
    store.write_bytes(path_of(BACKUPS, name, MANIFEST), json.dumps(body, indent=1).encode())


def committed_lineage(store: Store, cache: dict[int, Attempt] | None = None,
                      top: int | None = None) -> tuple[list[str], Listing]:
    """The committed backups the newest attempt (or attempt `top`) trusts, newest first, and the listing."""
    listing = scan(store)
    return lineage(read_attempts(store, listing, cache), listing.committed, top), listing


# --------------------------------------------------------------------------------------------
# Pruning and removal (the chief, after checking it is current)
# --------------------------------------------------------------------------------------------


def prune(store: Store, generation: int, keep: int, busy: set[str] = frozenset(),
          cache: dict[int, Attempt] | None = None) -> None:
    """Delete what no resume needs: backups of this or older generations outside the newest `keep`
    commits of the lineage (except `busy`: this attempt's backups still being uploaded), and attempt
    records older than every kept backup. Never anything of a newer generation."""
    trusted, listing = committed_lineage(store, cache, top=generation)
    kept = set(trusted[:max(int(keep), 1)])
    newest = trusted[0] if trusted else None
    doomed = []
    for name, objects in listing.backups.items():
        parsed = parse_name(name)
        if parsed is None or parsed[0] > generation or name in kept or name in busy:
            continue
        if parsed[0] == generation and newest is not None and name > newest:
            continue  # this attempt's newer backup, its commit still to come
        doomed += [path_of(BACKUPS, name, o) for o in objects if o != MANIFEST]
        if MANIFEST in objects:
            doomed.append(path_of(BACKUPS, name, MANIFEST))
    oldest = min((parse_name(n)[0] for n in kept), default=generation)  # type: ignore[index]
    for record, kinds in listing.records.items():
        if record < oldest:
            doomed += [_record_name(record, kind == "base") for kind in kinds]
    # Manifests first, then the files: a reader never finds a manifest whose files are going.
    store.remove_many([n for n in doomed if n.endswith("/" + MANIFEST)])
    store.remove_many([n for n in doomed if not n.endswith("/" + MANIFEST)])


def remove_all(store: Store, generation: int) -> None:
    """A finished run: delete every backup and attempt record of `generation` and older (manifests first)."""
    listing = scan(store)
    manifests, rest = [], []
    for name, objects in listing.backups.items():
        parsed = parse_name(name)
        if parsed is not None and parsed[0] <= generation:
            for o in objects:
                (manifests if o == MANIFEST else rest).append(path_of(BACKUPS, name, o))
    records = [_record_name(g, kind == "base") for g, kinds in listing.records.items() if g <= generation
               for kind in kinds]
    store.remove_many(manifests)
    store.remove_many(rest + records)
