"""`stratkit.data.Table`: a table on a disk or a store, described (not read) until it is planned.

    table = stratkit.data.Table.parquet("s3://lake/events/", columns=["x", "y"])
    table = stratkit.data.Table.delta("s3://lake/events_delta", version=3)
    table = stratkit.data.Table.tfrecord("gs://lake/shards/*.tfrecord", features={...})

A `Table` is small and pickles small (a driver can hand it to every task); `plan()` lists the files and reads
their footers (or scans the TFRecord headers) once and keeps the `Plan`, which then travels with it. A table
pinned to a snapshot (`pinned`) reads exactly that snapshot: a Delta version, or the files a listing found.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from stratkit.data.plan import Plan
from stratkit.data.sources import files as listing
from stratkit.errors import ConfigError

KINDS = ("parquet", "delta", "tfrecord")


class Table:
    """A Parquet, Delta or TFRecord table (see the module docstring); make one with `parquet`, `delta` or `tfrecord`."""

    def __init__(self, kind: str, path: Any, *, columns: Sequence[str] | None = None, filter: Any = None,
                 version: Any = None, features: dict[str, Any] | None = None,
                 files: Sequence[tuple[str, int, str]] | None = None) -> None:
        if kind not in KINDS:
            raise ConfigError(f"table kind {kind!r} is not one of {list(KINDS)}")
        self.kind = kind
        self.paths = [os.fspath(p) for p in path] if isinstance(path, (list, tuple)) else [os.fspath(path)]
        if not self.paths:
            raise ConfigError("a table needs a path, a glob or a list of files. Fix: e.g. "
                              "Table.parquet('s3://bucket/table/')")
        self.columns = None if columns is None else ([columns] if isinstance(columns, str) else list(columns))
        self.filter = filter
        self.version = version
        self.features = features
        self.files = None if files is None else [tuple(f) for f in files]
        self._plan: Plan | None = None
        self._lock = threading.Lock()

    # -- the constructors users call -------------------------------------------------------------------
    @classmethod
    def parquet(cls, path: Any, *, columns: Sequence[str] | None = None, filter: Any = None) -> Table:
        """Parquet files: a directory (read recursively; hive `key=value` directories give partition columns),
        a glob, one file, or a list of files; local paths or store URLs.

        Args:
            path: where the files are.
            columns: the columns to read (default: all; `TableInput` reads only those it feeds).
            filter: conditions on partition columns, e.g. `[("date", ">=", "2024-01-01")]` (files are pruned,
                rows never are).
        """
        return cls("parquet", path, columns=columns, filter=filter)

    @classmethod
    def delta(cls, path: Any, *, version: Any = None, columns: Sequence[str] | None = None,
              filter: Any = None) -> Table:
        """A Delta table (read with `deltalake`): the latest version when `fit` starts, or `version=` (a number, a
        datetime or an ISO 8601 string); recorded in the backups, so a resume reads the same version."""
        return cls("delta", path, version=version, columns=columns, filter=filter)

    @classmethod
    def tfrecord(cls, path: Any, *, features: dict[str, Any]) -> Table:
        """TFRecord files of `tf.train.Example`: a directory, a glob or a list; `features` maps each feature to
        its `tf.io.FixedLenFeature(shape, dtype)`."""
        table = cls("tfrecord", path, features=features)
        from stratkit.data.sources import tfrecord

        tfrecord.feature_columns(features)  # a bad spec is refused now, not when the plan is made
        return table

    # -- pickling: the description and the plan, no lock ---------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        if self.kind == "tfrecord" and self.features is not None:
            from stratkit.data.sources import tfrecord

            state["features"] = None
            state["_spec"] = tfrecord.feature_columns(self.features)[0]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = state.pop("_spec", None)
        self.__dict__.update(state)
        self._lock = threading.Lock()
        if spec is not None:
            from stratkit.data.sources import tfrecord

            self.features = tfrecord.parse_spec(spec)

    def __repr__(self) -> str:
        where = listing.shown_path(self.paths[0]) + (f" (+{len(self.paths) - 1})" if len(self.paths) > 1 else "")
        extra = f", version={self.version!r}" if self.kind == "delta" and self.version is not None else ""
        return f"Table.{self.kind}({where!r}{extra})"

    @property
    def shown(self) -> str:
        return listing.shown_path(self.paths[0])

    # -- snapshots --------------------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        """A Delta table's version this table reads (its latest unless pinned); None for other kinds."""
        if self.kind != "delta":
            return None
        if isinstance(self.version, int) and not isinstance(self.version, bool):
            return self.version
        from stratkit.data.sources import delta

        return int(delta.open_table(self.paths[0], self.version, self.shown).version())

    def at_version(self, version: int) -> Table:
        """This Delta table pinned to `version`."""
        return Table("delta", self.paths, version=int(version), columns=self.columns, filter=self.filter)

    def pinned(self, source: dict[str, Any]) -> Table:
        """This table reading the snapshot `source` describes (a plan's `source` record, from a backup)."""
        if source.get("kind") != self.kind:
            raise ConfigError(f"the backup was written reading a {source.get('kind')} table, but this run reads "
                              f"{self!r}. Fix: train on the same table to continue it, or move the backup away")
        if self.kind == "delta":
            return self.at_version(int(source["version"]))
        return Table(self.kind, self.paths, columns=self.columns, filter=self.filter, features=self.features,
                     files=[tuple(f) for f in source["files"]])

    def with_columns(self, columns: Sequence[str]) -> Table:
        """This table reading only `columns` (keeps a plan already made when it covers them)."""
        table = Table(self.kind, self.paths, columns=list(columns), filter=self.filter, version=self.version,
                      features=self.features, files=self.files)
        return table

    # -- the plan --------------------------------------------------------------------------------------
    @property
    def planned(self) -> bool:
        """Whether the plan is made (it then travels with the table, pickled)."""
        return self._plan is not None

    def plan(self) -> Plan:
        """The plan (made once: the listing and the footers read, the columns checked).

        Raises:
            ConfigError: a missing path or column, files whose schemas differ, nulls, a Delta version that does
                not exist, an unreadable file, a TFRecord feature spec that does not match the records.
        """
        with self._lock:
            if self._plan is None:
                self._plan = self._make_plan()
            return self._plan

    def _make_plan(self) -> Plan:
        from stratkit.storage.arrow import arrow_filesystem

        fs, base = arrow_filesystem(self.paths[0], "table path")
        shown = self._shower(base)
        if self.kind == "delta":
            return self._delta_plan(fs, base, shown)
        suffix = ".parquet" if self.kind == "parquet" else ""
        if self.files is not None:
            entries = [listing.FileEntry(p, int(size), str(tag)) for p, size, tag in self.files]
        else:
            entries = []
            for path in self.paths:
                fs_here, base_here = arrow_filesystem(path, "table path")
                if type(fs_here) is not type(fs):
                    raise ConfigError(f"the table's files {self.paths[0]!r} and {path!r} are on different stores. "
                                      "Fix: list files of one store")
                entries += listing.list_files(fs, base_here, listing.shown_path(path), suffix)
            entries = sorted(set(entries), key=lambda e: e.path)
        record = {"kind": self.kind, "path": self.shown, "files": [[e.path, e.size, e.tag] for e in entries]}
        if self.kind == "tfrecord":
            from stratkit.data.sources import tfrecord

            return tfrecord.plan_files(root=self.paths[0], source=record, fs=fs, entries=entries,
                                       features=self.features or {}, shown=shown)
        from stratkit.data.sources import parquet

        root = listing.glob_split(fs, base)[0]
        values, types = listing.hive_partitions([e.path for e in entries], root.rstrip("/"))
        conditions = listing.check_filter(self.filter, types)
        if conditions:
            kept = [i for i, v in enumerate(values) if listing.passes(v, conditions)]
            if not kept:
                raise ConfigError(f"filter={self.filter!r} keeps none of the {len(entries)} files of {self.shown!r}. "
                                  "Fix: loosen the filter")
            entries = [entries[i] for i in kept]
            values = [values[i] for i in kept]
            record["files"] = [[e.path, e.size, e.tag] for e in entries]
        return parquet.plan_files(kind="parquet", root=self.paths[0], source=record, fs=fs, entries=entries,
                                  columns=self.columns, partitions=values, partition_types=types, shown=shown)

    def _delta_plan(self, fs: Any, base: str, shown: Any) -> Plan:
        from urllib.parse import unquote

        from stratkit.data.sources import delta, parquet

        table = delta.open_table(self.paths[0], self.version, self.shown)
        snap = delta.snapshot(table, self.paths[0], self.shown, self.columns)
        conditions = listing.check_filter(self.filter, snap["partition_types"])
        rows = [i for i, v in enumerate(snap["partitions"]) if listing.passes(v, conditions)]
        if not rows:
            raise ConfigError(f"the Delta table {self.shown!r} at version {snap['version']} has no files"
                              + (f" that pass filter={self.filter!r}" if conditions else "") + ". Fix: check the "
                              "version and the filter")
        order = sorted(rows, key=lambda i: snap["paths"][i])
        entries, masks, values = [], {}, []
        for index, i in enumerate(order):
            relative = unquote(snap["paths"][i])
            path = relative if "://" in relative else f"{base.rstrip('/')}/{relative}"
            entries.append(listing.FileEntry(path, int(snap["sizes"][i]), ""))
            values.append(snap["partitions"][i])
            for uri, keep in snap["masks"].items():
                if unquote(uri).endswith("/" + relative):
                    masks[index] = keep
        record = {"kind": "delta", "path": self.shown, "version": snap["version"]}
        return parquet.plan_files(kind="delta", root=self.paths[0], source=record, fs=fs, entries=entries,
                                  columns=self.columns, partitions=values, partition_types=snap["partition_types"],
                                  deletions=masks, shown=shown)

    def _shower(self, base: str) -> Any:
        """path (as the filesystem names it) -> as messages show it (the user's URL scheme kept)."""
        scheme = self.paths[0].split("://", 1)[0] + "://" if "://" in self.paths[0] else ""
        if not scheme or scheme == "file://":
            return lambda path: path
        return lambda path: listing.shown_path(scheme + path.lstrip("/"))


__all__ = ["KINDS", "Table"]
