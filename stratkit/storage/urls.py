"""What a path names: a local file, or an object in a store (s3://, gs://, az://, hdfs://, ...), and which extra reads it.

The one place that tells a URL from a local path. Everything that takes a
path from the user (`backup_dir`, `Trainer.save`, `model.save` under
stratkit's save guards, the callbacks stratkit routes, Spark staging) asks
here, so a path such as ``s3://bucket/run`` never becomes a local directory
named ``s3:``. A path that *looks* like a local directory named after a
scheme (``s3:/bucket/run``, one slash: a URL typed wrong) is refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from stratkit.errors import ConfigError

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.DOTALL)


@dataclass(frozen=True)
class Scheme:
    """A store's URL scheme: the fsspec protocol that reads it, the module it needs and stratkit's extra."""

    protocol: str
    module: str
    extra: str
    package: str


#: The stores stratkit tests against (and HDFS, through pyarrow: unit-tested only, no HDFS server runs here).
#: Other schemes fsspec knows are accepted as fsspec reads them; an unknown one is refused.
SCHEMES: dict[str, Scheme] = {
    "s3": Scheme("s3", "s3fs", "s3", "s3fs"),
    "s3a": Scheme("s3", "s3fs", "s3", "s3fs"),
    "gs": Scheme("gs", "gcsfs", "gcs", "gcsfs"),
    "gcs": Scheme("gs", "gcsfs", "gcs", "gcsfs"),
    "az": Scheme("az", "adlfs", "azure", "adlfs"),
    "abfs": Scheme("abfs", "adlfs", "azure", "adlfs"),
    "abfss": Scheme("abfs", "adlfs", "azure", "adlfs"),
    "hdfs": Scheme("hdfs", "pyarrow", "hdfs", "pyarrow"),
    "viewfs": Scheme("viewfs", "pyarrow", "hdfs", "pyarrow"),
}


def split(path: str | os.PathLike[str]) -> tuple[str | None, str]:
    """(scheme in lower case, the rest) of a URL; (None, path) for a plain path."""
    text = os.fspath(path)
    match = _URL.match(text) if isinstance(text, str) else None
    if match is None:
        return None, text
    return match["scheme"].lower(), match["rest"]


def is_url(path: Any) -> bool:
    """True for a store URL (``s3://...``, ``gs://...``, ...); False for a local path or a ``file://`` URL."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    scheme, _ = split(path)
    return scheme is not None and scheme != "file"


def local_path(path: str | os.PathLike[str], what: str = "path") -> str | None:
    """The local path `path` names (a plain path, or ``file://`` + an absolute path), None for a store URL.

    Raises:
        ConfigError: a ``file://`` URL naming another host, or a local path whose first part is a store's
            scheme with a colon (``s3:/bucket``: a URL missing a slash, which would become a directory ``s3:``).
    """
    scheme, rest = split(path)
    if scheme is None:
        check_not_scheme_dir(rest, what)
        return rest
    if scheme != "file":
        return None
    parts = urlsplit(os.fspath(path))
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"{what}={os.fspath(path)!r} names a file on host {parts.netloc!r}; a file:// URL names "
                          "a file of this machine. Fix: file:///absolute/path (three slashes), or a store URL")
    return parts.path or "/"


def check_not_scheme_dir(path: str, what: str) -> None:
    """Refuse a local path that starts with a store's scheme and a colon: the user meant a URL."""
    first = path.split(os.sep, 1)[0] if path else ""
    if first.endswith(":") and first[:-1].lower() in SCHEMES:
        scheme = first[:-1]
        rest = path[len(first):].lstrip("/")
        raise ConfigError(f"{what}={path!r} would be a local directory named {first!r}: it reads as a "
                          f"{scheme}:// URL with a slash missing. Fix: {what}='{scheme}://{rest}'")


def scheme_of(url: str) -> Scheme | None:
    """The known scheme of `url` (None for a scheme stratkit has no table row for)."""
    scheme, _ = split(url)
    return SCHEMES.get(scheme or "")


def redact(url: str | os.PathLike[str]) -> str:
    """`url` without what can hold a secret (a user:password@ part, a query string such as a SAS token)."""
    text = os.fspath(url)
    if not is_url(text):
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return split(text)[0] + "://..."  # type: ignore[operator]
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def join(base: str, *names: str) -> str:
    """`base` / names, for a URL (always "/") or a local path (os.path.join)."""
    if not is_url(base):
        return os.path.join(base, *names)
    out = base.rstrip("/")
    for name in names:
        if name:
            out += "/" + name.strip("/")
    return out


def basename(path: str) -> str:
    """The last part of a URL or path (a trailing slash ignored)."""
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path.rstrip(os.sep))

