"""A directory or a URL prefix, read and written one whole object (file) at a time.

`Store` is the one interface every stratkit writer and reader of user files
goes through, local or remote: backups, `Trainer.save`, `model.save` under the
save guards, the callbacks' files, Spark staging. A local store is a
directory (`stratkit.files` rules: private temporaries, fsync, rename); a
remote store is a prefix in an object store reached through fsspec (s3fs,
gcsfs, adlfs; pyarrow for HDFS), with the credentials and endpoint the
store's own environment gives (`AWS_*`, `GOOGLE_APPLICATION_CREDENTIALS`,
`STORAGE_EMULATOR_HOST`, `AZURE_STORAGE_*`, ...) or fsspec's configuration
(`FSSPEC_S3_ENDPOINT_URL=...`, `FSSPEC_GS='{"token": "anon"}'`, a file in
`FSSPEC_CONFIG_DIR`), which every process of a cluster inherits.

What is atomic: one object. An object store never shows half an object (a
PUT, a multipart upload, a resumable upload or a block list appears whole
when it completes), and there is no rename to build more on (on S3 a rename is
a copy). So `write_bytes` and `upload` replace one object whole, and anything
of several objects commits by writing one object last that names the others
(the backups' manifest, `stratkit.training.checkpoint`).

Listings are never cached (`use_listings_cache=False`): other processes write
the same prefix, and a cached listing would hide their objects.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

from stratkit import files
from stratkit.storage import urls
from stratkit.storage.errors import StoreError, translate

#: The start-up probe's objects (`stratkit.storage.check_store`: written and deleted at once, yet a listing
#: made meanwhile shows one).
PROBE_PREFIX = ".stratkit-probe-"


class Store:
    """A local directory or a prefix of an object store.

    Names are relative to the store ("a/b.txt", always with "/"). Missing
    objects raise `FileNotFoundError`; any other failure of a remote store
    raises `StoreError` (an `OSError` saying what went wrong, without
    credentials), so callers can retry or explain it.

    Args:
        url: the directory or URL (``s3://bucket/prefix``).
        fs: the fsspec filesystem of a remote store (None for a local directory).
        root: the store's root as `fs` names it (a local path for a local store).
    """

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url = url.rstrip("/") if urls.is_url(url) else url
        self.fs = fs
        self.root = root.rstrip("/") if fs is not None else root

    def __repr__(self) -> str:
        return f"Store({urls.redact(self.url)!r})"

    @property
    def local(self) -> bool:
        """True for a local directory."""
        return self.fs is None

    @property
    def shown(self) -> str:
        """The URL or path as messages show it (nothing secret in it)."""
        return urls.redact(self.url)

    # -- names ---------------------------------------------------------------------------------
    def path(self, name: str = "") -> str:
        """The URL (or local path) of `name` in this store."""
        return urls.join(self.url, name) if not self.local else (os.path.join(self.root, name) if name else self.root)

    def _key(self, name: str) -> str:
        return f"{self.root}/{name.strip('/')}" if name else self.root

    def child(self, name: str) -> Store:
        """The store at the prefix `name` inside this one."""
        if self.local:
            return Store(os.path.join(self.root, name), None, os.path.join(self.root, name))
        return Store(urls.join(self.url, name), self.fs, self._key(name))

    # -- reading -------------------------------------------------------------------------------
    def exists(self, name: str = "") -> bool:
        """Whether `name` is an object (or, for "" / a prefix, holds any)."""
        if self.local:
            return os.path.exists(self.path(name))
        return bool(self._call("look for", name, lambda: self.fs.exists(self._key(name))))

    def size(self, name: str) -> int:
        """The size in bytes of the object `name` (FileNotFoundError if it is missing)."""
        if self.local:
            return os.path.getsize(self.path(name))
        info = self._call("read", name, lambda: self.fs.info(self._key(name)))
        if info.get("type") == "directory":
            raise FileNotFoundError(f"{self.path(name)} is a prefix, not an object")
        return int(info.get("size") or 0)

    def list(self, prefix: str = "") -> list[str]:
        """Every object under `prefix` (recursively), as names relative to this store, sorted."""
        if self.local:
            top = self.path(prefix)
            found = []
            for directory, _, names in os.walk(top):
                for name in names:
                    if not name.startswith(files.TEMP_PREFIX):
                        found.append(os.path.relpath(os.path.join(directory, name), self.root).replace(os.sep, "/"))
            return sorted(found)
        base = self._key(prefix)
        try:
            keys = self._call("list", prefix, lambda: self.fs.find(base, withdirs=False))
        except FileNotFoundError:
            return []
        return sorted(k[len(self.root) + 1:] for k in keys if k.startswith(self.root + "/"))

    def read_bytes(self, name: str) -> bytes:
        """The whole object `name`."""
        if self.local:
            with open(self.path(name), "rb") as handle:
                return handle.read()
        return self._call("read", name, lambda: self.fs.cat_file(self._key(name)))

    def open(self, name: str) -> Any:
        """The object `name` as a binary file for reading, with seek (Parquet reads a footer, then row groups).

        A remote object is read in ranged requests as the reader asks; the caller closes it (``with``).
        """
        if self.local:
            return open(self.path(name), "rb")  # the caller's `with` closes it
        return self._call("open", name, lambda: self.fs.open(self._key(name), "rb"))

    def download(self, name: str, local_file: str) -> None:
        """Copy the object `name` to `local_file` (written under a temporary name, then renamed)."""
        os.makedirs(os.path.dirname(os.path.abspath(local_file)), exist_ok=True)
        if self.local:
            files.write_with(local_file, lambda tmp: shutil.copyfile(self.path(name), tmp))
            return
        files.write_with(local_file, lambda tmp: self._call("download", name,
                                                            lambda: self.fs.get_file(self._key(name), tmp)))

    # -- writing -------------------------------------------------------------------------------
    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace the object `name` with `data`, whole: a reader sees the old object or the new one."""
        if self.local:
            path = self.path(name)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            files.write_bytes(path, data)
            return
        self._call("write", name, lambda: self.fs.pipe_file(self._key(name), data))

    def upload(self, local_file: str, name: str) -> None:
        """Replace the object `name` with the local file's content, whole."""
        if self.local:
            path = self.path(name)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            files.write_with(path, lambda tmp: shutil.copyfile(local_file, tmp))
            return
        self._call("upload", name, lambda: self.fs.put_file(local_file, self._key(name)))

    def remove(self, name: str) -> None:
        """Delete the object `name` (nothing if it is missing)."""
        if self.local:
            files.remove(self.path(name))
            return
        try:
            self._call("delete", name, lambda: self.fs.rm_file(self._key(name)))
        except FileNotFoundError:
            pass

    def remove_all(self, prefix: str = "", keep: Iterable[str] = ()) -> None:
        """Delete every object under `prefix` except the names in `keep`."""
        kept = set(keep)
        for name in self.list(prefix):
            if name not in kept:
                self.remove(name)
        if self.local:
            _remove_empty_dirs(self.path(prefix))

    # -- directories ---------------------------------------------------------------------------
    def upload_dir(self, local_dir: str, prefix: str, last: Iterable[str] = ()) -> list[str]:
        """Upload every file under `local_dir` to `prefix`; the names in `last` (relative) go last.

        Returns the names written (relative to `prefix`). Objects under `prefix`
        that the directory does not hold are deleted afterwards, so the prefix
        ends up holding the directory: a reader that finds a `last` file finds
        every other file of the same upload already in place.
        """
        names = []
        for directory, _, entries in os.walk(local_dir):
            for entry in entries:
                names.append(os.path.relpath(os.path.join(directory, entry), local_dir).replace(os.sep, "/"))
        final = [n for n in names if n in set(last)]
        for name in sorted(n for n in names if n not in set(final)) + final:
            self.upload(os.path.join(local_dir, name), urls_join(prefix, name))
        self.remove_all(prefix, keep={urls_join(prefix, n) for n in names})
        return names

    def download_dir(self, prefix: str, local_dir: str) -> list[str]:
        """Copy every object under `prefix` into `local_dir`; returns the names copied."""
        names = []
        for name in self.list(prefix):
            relative = name[len(prefix.strip("/")) + 1:] if prefix else name
            self.download(name, os.path.join(local_dir, *relative.split("/")))
            names.append(relative)
        return names

    # -- errors --------------------------------------------------------------------------------
    def _call(self, action: str, name: str, operation: Any) -> Any:
        try:
            return operation()
        except FileNotFoundError:
            raise
        except Exception as exc:
            error = translate(exc, action, self.path(name))
            if isinstance(error, FileNotFoundError):
                raise error from None
            raise error from exc


def urls_join(prefix: str, name: str) -> str:
    """`prefix`/`name` as store names ("" prefix: `name`)."""
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def _remove_empty_dirs(top: str) -> None:
    for directory, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(directory)
        except OSError:
            pass


def temporary_dir(prefix: str = "stratkit-store-") -> str:
    """A private local directory for a file on its way to or from a store (the caller removes it)."""
    return tempfile.mkdtemp(prefix=prefix)


__all__ = ["PROBE_PREFIX", "Store", "StoreError", "temporary_dir", "urls_join"]
