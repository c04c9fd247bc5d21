"""Reading a committed backup back from the store: its manifest, and the files a worker needs, checked.

A reader takes only backups with a manifest (`commit`), in the lineage the
newest attempt trusts, newest first. Of each it reads the files its worker
resumes from (the weights, and its own state, or the chief's where the backup
holds none of its own: a worker new to the world), downloads each one that is
not already there intact to a private temporary and renames it into place,
and checks its size and SHA-256 against the manifest before anything reads
it. A backup with a missing or damaged file is skipped (and said), the next
older one tried; if every committed backup fails, nothing is resumed and
nothing is deleted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from stratkit import files
from stratkit.errors import ConfigError
from stratkit.storage import Store, open_store
from stratkit.training.checkpoint.commit import BACKUPS, MANIFEST, Attempt, committed_lineage, parse_name, part, path_of
from stratkit.training.checkpoint.layout import ARRAYS, STATE, WEIGHTS, WHAT, Position, position_of, sha256


def read_manifest(store: Store, name: str) -> dict[str, Any]:
    """The manifest of `name`, checked for the fields a reader uses (ValueError if it does not have them)."""
    try:
        body = json.loads(store.read_bytes(path_of(BACKUPS, name, MANIFEST)))
        position = Position(int(body["epoch"]), int(body["step"]))
        entries = {str(k): (str(v["sha256"]), int(v["size"])) for k, v in dict(body["files"]).items()}
        if parse_name(name) != (int(body["generation"]), position) or body["weights"] not in entries:
            raise ValueError(f"it names {position} of attempt {body['generation']}, not {name}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(str(exc)) from None
    body["position"], body["entries"] = position, entries
    return body


def needed(manifest: dict[str, Any], rank: int) -> dict[str, tuple[str, int]]:
    """The files worker `rank` resumes from: the weights, and its own state (the chief's where it has none)."""
    entries = manifest["entries"]
    own = [n for n in entries if n.startswith(part(rank) + "/")]
    chosen = own or [n for n in entries if n.startswith(part(int(manifest.get("chief", 0))) + "/")]
    return {n: entries[n] for n in [manifest["weights"], *chosen]}


def materialize(store: Store, name: str, manifest: dict[str, Any], rank: int, target: str) -> dict[str, str]:
    """Put the files worker `rank` needs of backup `name` in the local directory `target` and check them.

    A file already there with the manifest's checksum is kept (a restart on the same host downloads
    nothing); any other is downloaded (a private temporary, then a rename). Returns {part: local path}
    ("weights.h5", "state.json", "arrays.npz").

    Raises:
        ValueError: a file does not match the manifest (its size or SHA-256), naming it.
        OSError: the store could not be read (`StoreError`, or FileNotFoundError for a missing object).
    """
    files.check_dir(target, WHAT)
    out: dict[str, str] = {}
    for relative, (digest, size) in needed(manifest, rank).items():
        local = os.path.join(target, relative.rsplit("/", 1)[-1])
        kind = position_of(os.path.basename(local))
        if kind is None or kind[0] != manifest["position"] or kind[1] not in (WEIGHTS, STATE, ARRAYS):
            raise ValueError(f"{relative} is not a file of the backup at {manifest['position']}")
        if not (os.path.isfile(local) and os.path.getsize(local) == size and sha256(local) == digest):
            store.download(path_of(BACKUPS, name, relative), local)
            if os.path.getsize(local) != size or sha256(local) != digest:
                files.remove(local)
                raise ValueError(f"{relative} is corrupt (its size or SHA-256 does not match the manifest)")
        out[kind[1]] = local
    return out


@dataclass
class Chosen:
    """A committed backup read back: its name, manifest and the local files (part -> path)."""

    name: str
    manifest: dict[str, Any]
    paths: dict[str, str]


def newest_verified(store: Store, rank: int, target: str, cache: dict[int, Attempt] | None = None,
                    top: int | None = None) -> tuple[Chosen | None, list[str]]:
    """The newest committed backup of the lineage whose files (those worker `rank` needs) verify, read into
    `target`; and what was skipped on the way ("<name> (<why>)", newest first; with nothing committed, the
    backups that never were).

    Raises:
        ConfigError: there are committed backups, but none can be used (nothing is deleted).
        StoreError: the store failed (not a missing or damaged file: that one is skipped).
    """
    names, listing = committed_lineage(store, cache, top)
    skipped = []
    if not names:  # nothing committed: say what is there that never was (a run killed in its first upload)
        skipped = [f"{name} (never committed: no manifest)" for name in sorted(listing.backups, reverse=True)[:3]]
    for name in names:
        try:
            manifest = read_manifest(store, name)
            return Chosen(name, manifest, materialize(store, name, manifest, rank, target)), skipped
        except (ValueError, FileNotFoundError) as exc:
            skipped.append(f"{name} ({exc})")
    if names:
        raise ConfigError(f"{WHAT}={store.shown!r}: no committed backup can be used: {'; '.join(skipped)}. Nothing "
                          "was deleted. Fix: move those backups away (or pass another backup_dir) to start over, or "
                          "put back intact copies of those files")
    return None, skipped


def committed_positions(url: str) -> list[Position]:
    """The positions of the committed backups in the store at `url` a resume would consider, newest first.

    Nothing is downloaded or checked (see `find_resume_point` for that): for engines and tests that wait
    for a commit.
    """
    names, _ = committed_lineage(open_store(url, WHAT))
    return [parse_name(n)[1] for n in names]  # type: ignore[index]
