"""The files of a table on a disk or a store: listing (a directory, a glob, a list), hive partitions, the filter.

A directory is read recursively, every file except the ones Spark, Hive and Delta keep beside the data (names
starting with "_" or ".", e.g. `_SUCCESS`, `_delta_log/`) and those not ending with the suffix asked for. A
glob (`*`, `?`, `[`) matches names under the directory before its first wildcard, one directory level per part as
Spark and the shell match (`t/*.parquet` is t's own files; `**` is any number of levels); a path that exists as
written is read as written, wildcard characters and all. A hive-partitioned tree
(`.../date=2024-01-01/part=3/file.parquet`) gives each file its partition values, %-decoded (`New%20York`), Hive's
`__HIVE_DEFAULT_PARTITION__` a null: an integer when every file's value for that key is one, else a string.
`filter` keeps the files whose partition values pass every condition (`[("date", ">=", "2024-01-01"), ("part",
"in", [1, 2])]`: a conjunction); it prunes files, it never reads rows, so it names partition columns only.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence
from urllib.parse import unquote

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.storage import redact

_OPS = ("=", "==", "!=", "<", "<=", ">", ">=", "in", "not in")
_WILDCARD = re.compile(r"[*?\[]")
#: The directory name Hive, Spark and pyarrow give a partition whose value is null.
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"

log = status.logger(__name__)


@dataclass(frozen=True)
class FileEntry:
    """One data file: its path as the filesystem names it, its size and a tag that changes when it is rewritten."""

    path: str
    size: int
    tag: str


def glob_match(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    """Whether a path's parts match a glob's: each part by `fnmatch` (no part crosses a "/"), `**` any number."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and glob_match(parts[1:], pattern[1:])


def glob_split(fs: Any, base: str) -> tuple[str, str | None]:
    """(where a listing of `base` starts, its glob pattern or None). A path with `*`, `?` or `[` is a glob unless
    it exists as written (a directory named `run[1]` is that directory)."""
    import pyarrow.fs as pafs

    match = _WILDCARD.search(base)
    if not match:
        return base, None
    try:
        if fs.get_file_info(base).type != pafs.FileType.NotFound:
            return base, None
    except (OSError, ValueError):
        pass
    return base[:match.start()].rsplit("/", 1)[0], base


def list_files(fs: Any, base: str, shown: str, suffix: str) -> list[FileEntry]:
    """Every data file `base` names (a file, a directory read recursively, or a glob), sorted by path.

    Raises:
        ConfigError: nothing there, or no file with `suffix` (naming the path and the fix).
    """
    import pyarrow.fs as pafs

    base, pattern = glob_split(fs, base)
    try:
        info = fs.get_file_info(base)
    except OSError as exc:
        raise ConfigError(f"table path {shown!r} cannot be read: {exc}. Fix: check the path, the store's endpoint "
                          "and credentials") from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"table path {shown!r} does not exist. Fix: check the path or URL")
    if info.type == pafs.FileType.File:
        return [FileEntry(info.path, int(info.size), _tag(info))]
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except OSError as exc:
        raise ConfigError(f"table path {shown!r} cannot be listed: {exc}. Fix: check the store's endpoint and "
                          "credentials") from None
    wanted = pattern.split("/") if pattern is not None else None
    out, skipped = [], []
    for entry in infos:
        if entry.type != pafs.FileType.File:
            continue
        relative = entry.path[len(base):].lstrip("/")
        if any(part.startswith(("_", ".")) for part in relative.split("/")):
            continue
        parts = entry.path.split("/")
        named = wanted is not None and glob_match(parts, wanted)
        if wanted is not None and not named and not _under_match(parts, wanted):
            continue
        if suffix and not entry.path.endswith(suffix) and not named:   # a file the glob names is read as named
            skipped.append(relative)
            continue
        out.append(FileEntry(entry.path, int(entry.size), _tag(entry)))
    if not out:
        raise ConfigError(f"table path {shown!r} holds no {suffix or 'data'} files. Fix: point it at the table's "
                          "directory, a glob of its files, or a list of files")
    if skipped:  # Hive writes its data files without a suffix (000000_0): say what was left out, once a listing
        log.warning("table path %r: %d file(s) without %s were not read, e.g. %r. A table whose data files have "
                    "no suffix is read with a glob (e.g. %r) or a list of its files", shown, len(skipped), suffix,
                    sorted(skipped)[0], shown.rstrip("/") + "/*")
    return sorted(out, key=lambda e: e.path)


def _under_match(parts: list[str], pattern: list[str]) -> bool:
    """Whether a file lies under a directory the glob matches (read as that directory's files, as Spark reads a
    matched directory); a pattern with `**` matches files only."""
    return "**" not in pattern and len(parts) > len(pattern) and glob_match(parts[:len(pattern)], pattern)


def _tag(info: Any) -> str:
    mtime = getattr(info, "mtime_ns", None)
    return str(mtime) if mtime is not None else ""


def hive_partitions(paths: Sequence[str], base: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each path's partition values (key=value directories below `base`), typed alike; and key -> dtype.

    Values are %-decoded as Spark, Hive and pyarrow write them (`city=New%20York` is "New York"), and Hive's
    `__HIVE_DEFAULT_PARTITION__` is a null (None): a filter's comparisons with it are false, and a partition
    column read as a feature with a null is refused (`parquet.plan_files`)."""
    raw: list[dict[str, str | None]] = []
    for path in paths:
        relative = path[len(base):].strip("/") if path.startswith(base) else path
        values: dict[str, str | None] = {}
        for part in relative.split("/")[:-1]:
            if "=" in part:
                key, value = part.split("=", 1)
                values[unquote(key)] = None if value == HIVE_NULL else unquote(value)
        raw.append(values)
    keys = sorted({k for values in raw for k in values})
    types = {}
    for key in keys:
        missing = [paths[i] for i, values in enumerate(raw) if key not in values]
        if missing:
            raise ConfigError(f"partition key {key!r} is missing from the path of {missing[0]!r} (other files of the "
                              "table have it). Fix: read one partitioned tree, or list the files yourself")
        given = [values[key] for values in raw if values[key] is not None]
        types[key] = "int64" if given and all(re.fullmatch(r"-?\d{1,18}", v) for v in given) else "string"
    typed = [{k: (int(v) if types[k] == "int64" and v is not None else v) for k, v in values.items()}
             for values in raw]
    return typed, types


def check_filter(conditions: Any, keys: Iterable[str]) -> list[tuple[str, str, Any]]:
    """`filter` as a checked list of (key, op, value) on partition keys.

    Raises:
        ConfigError: a malformed condition, an unknown operator, or a key that is not a partition column.
    """
    if conditions is None:
        return []
    if isinstance(conditions, tuple) and len(conditions) == 3 and isinstance(conditions[0], str):
        conditions = [conditions]
    known = list(keys)
    out = []
    for condition in conditions:
        if not (isinstance(condition, (tuple, list)) and len(condition) == 3):
            raise ConfigError(f"filter condition {condition!r} is not (column, op, value). Fix: e.g. "
                              "filter=[('date', '>=', '2024-01-01')]")
        key, op, value = condition
        if op not in _OPS:
            raise ConfigError(f"filter condition {condition!r}: operator {op!r} is not one of {list(_OPS)}")
        if key not in known:
            raise ConfigError(f"filter condition {condition!r} names {key!r}, which is not a partition column of "
                              f"the table (partition columns: {known or 'none'}). A filter prunes whole files; it "
                              "never drops rows inside one (that would change the row counts the order is built "
                              "on). Fix: filter on a partition column, or write the rows you want to a table of "
                              "their own")
        out.append((key, op, value))
    return out


def passes(values: dict[str, Any], conditions: list[tuple[str, str, Any]]) -> bool:
    """Whether a file's partition values pass every condition."""
    for key, op, wanted in conditions:
        have = values.get(key)
        if have is None:   # a null partition: only `= None` and `in [..., None]` keep it (SQL's null compares false)
            if not ((op in ("=", "==") and wanted is None) or (op == "in" and None in list(wanted))):
                return False
            continue
        if op in ("in", "not in"):
            inside = have in set(wanted) or str(have) in {str(w) for w in wanted}
            if inside != (op == "in"):
                return False
            continue
        if isinstance(have, int) and not isinstance(wanted, int):
            try:
                wanted = int(wanted)
            except (TypeError, ValueError):
                have = str(have)
        elif isinstance(have, str):
            wanted = str(wanted)
        ok = {"=": have == wanted, "==": have == wanted, "!=": have != wanted, "<": have < wanted,
              "<=": have <= wanted, ">": have > wanted, ">=": have >= wanted}[op]
        if not ok:
            return False
    return True


def shown_path(root: str | os.PathLike[str]) -> str:
    """The table's path as messages show it (no secret)."""
    return redact(os.fspath(root))


__all__ = ["HIVE_NULL", "FileEntry", "check_filter", "glob_split", "hive_partitions", "list_files", "passes",
           "shown_path"]
