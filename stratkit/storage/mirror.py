"""A local directory that a writer fills, kept in step with a store prefix: pushed whole file by whole file.

For writers that only write local files as they go (Keras's `ModelCheckpoint`,
`CSVLogger`, `TensorBoard`, `BackupAndRestore`): they write into a local
staging directory, and `Mirror.push` uploads every file that changed since the
last push (each upload replaces one object whole), then deletes the objects of
files that went away (only names this mirror pulled or pushed: a prefix shared
with other files keeps them).

Several files that must be read together (Keras's `BackupAndRestore`: the
weights and the epoch they belong to) need more than whole objects: with
``manifest=True`` every push ends with one more object, ``.stratkit-mirror.json``,
naming each file with its size and SHA-256; the files named in `last` are
uploaded after the others. A push cut short (the process killed between two
uploads) leaves objects newer than the manifest; `pull` then takes, for each
file whose object does not match the manifest, another object of the prefix
that does (Keras's double checkpoint keeps the previous pair as ``*.bkp``, and
the ``.bkp`` files go first), so a reader gets the pair the last complete push
committed. With no object to take, the newer object is kept and a warning says
the pair may be torn (what Keras's own local files give after such a crash).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

from stratkit import files
from stratkit.storage.store import PROBE_PREFIX, Store

log = logging.getLogger(__name__)

MANIFEST = ".stratkit-mirror.json"


class Mirror:
    """`local_dir` kept in step with `store` (the local directory is the writer's; the store follows).

    Args:
        local_dir: the staging directory the writer fills.
        store: where its files go (`stratkit.storage.open_store`).
        manifest: end every push with a manifest and verify against it on `pull` (files read together).
        last: names (relative) uploaded after every other changed file of a push.
    """

    def __init__(self, local_dir: str, store: Store, *, manifest: bool = False, last: Iterable[str] = ()) -> None:
        self.local_dir = local_dir
        self.store = store
        self.manifest = manifest
        self.last = tuple(last)
        self._pushed: dict[str, tuple[int, int]] = {}   # name -> (size, mtime_ns) when last pushed or pulled
        self._known: set[str] = set()                   # names in the store this mirror answers for

    def __repr__(self) -> str:
        return f"Mirror({self.local_dir!r} -> {self.store!r})"

    # -- local ---------------------------------------------------------------------------------
    def _local_files(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for directory, _, names in os.walk(self.local_dir):
            for name in names:
                if name.startswith(files.TEMP_PREFIX):
                    continue                         # a file still being written
                path = os.path.join(directory, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                found[os.path.relpath(path, self.local_dir).replace(os.sep, "/")] = (info.st_size, info.st_mtime_ns)
        return found

    # -- store -> local ------------------------------------------------------------------------
    def pull(self, names: Iterable[str] | None = None) -> list[str]:
        """Download the prefix's files (or only `names`) into the local directory; the names downloaded.

        With a manifest, the files the last complete push committed (see the module's docstring).
        """
        wanted = None if names is None else set(names)
        found = [n for n in self.store.list() if n != MANIFEST and not n.rsplit("/", 1)[-1].startswith(PROBE_PREFIX)
                 and (wanted is None or n in wanted)]
        os.makedirs(self.local_dir, exist_ok=True)
        listed = []
        for name in found:
            try:
                self.store.download(name, self._local(name))
            except FileNotFoundError:
                continue                             # deleted since the listing (a writer's own clean-up)
            listed.append(name)
        if self.manifest and listed:
            self._settle(listed)
        local = self._local_files()
        for name in listed:
            if name in local:
                self._pushed[name] = local[name]
        self._known.update(listed)
        return sorted(listed)

    def _settle(self, listed: list[str]) -> None:
        """Make the pulled files the ones the manifest names (objects newer than it replaced by a match)."""
        try:
            committed = json.loads(self.store.read_bytes(MANIFEST))["files"]
        except FileNotFoundError:
            return                                   # written by something else: taken as it is
        sums = {name: files.sha256(self._local(name)) for name in listed}
        by_sum = {digest: name for name, digest in sums.items()}
        sources: dict[str, str] = {}
        for name, entry in committed.items():
            if name not in sums or sums[name] == entry["sha256"]:
                continue
            source = by_sum.get(entry["sha256"])
            if source is None:   # a `last` file read with others: say so; any other (a .bkp) goes with it
                log.log(logging.WARNING if name in self.last else logging.DEBUG,
                        "%s: %s is newer than the last complete upload and no copy of the committed one is left; "
                        "it is used as it is (the files read with it may be older)", self.store.shown, name)
                continue
            sources[name] = source
        contents = {}
        for name, source in sources.items():   # every source read before any file is replaced
            with open(self._local(source), "rb") as handle:
                contents[name] = handle.read()
        for name, data in contents.items():
            files.write_bytes(self._local(name), data)
            log.info("%s: %s was newer than the last complete upload: the committed copy is used", self.store.shown,
                     name)

    def _local(self, name: str) -> str:
        return os.path.join(self.local_dir, *name.split("/"))

    # -- local -> store ------------------------------------------------------------------------
    def push(self) -> list[str]:
        """Upload what changed since the last push, delete what went away; the names uploaded."""
        local = self._local_files()
        changed = [name for name, stamp in local.items() if self._pushed.get(name) != stamp]
        gone = sorted(self._known - set(local))
        if not changed and not gone:
            return []
        order = sorted(n for n in changed if n not in self.last) + [n for n in self.last if n in changed]
        for name in order:
            self.store.upload(self._local(name), name)
            self._pushed[name] = local[name]
        self._known.update(order)
        for name in gone:
            self.store.remove(name)
            self._known.discard(name)
            self._pushed.pop(name, None)
        if self.manifest:
            if local:
                entries = {name: {"size": local[name][0], "sha256": files.sha256(self._local(name))} for name in local}
                self.store.write_bytes(MANIFEST, json.dumps({"files": entries}, sort_keys=True).encode())
            else:
                self.store.remove(MANIFEST)        # the writer removed everything (a finished backup)
        return order


__all__ = ["MANIFEST", "Mirror"]
