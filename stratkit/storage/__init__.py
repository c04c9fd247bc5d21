"""Where a user's path leads: a local file or an object in a store, one layer under every path stratkit takes.

Every place that takes a path from the user (`Trainer.fit(backup_dir=)`,
`Trainer.save`, `model.save`/`save_weights`/`export` under stratkit's save
guards, the callbacks stratkit routes, `DataFrameInput` staging, the runners'
results) goes through this package, so ``s3://``, ``gs://``, ``az://``/``abfs://``,
``hdfs://`` and ``file://`` work wherever a path does, and a URL is never
written to a local directory named after its scheme.

* `open_store(path, what)`: the `Store` for a directory or URL prefix; a URL
  whose filesystem is not installed is a `ConfigError` naming the extra to
  install (``pip install "stratkit[s3]"``).
* `check_store(path, what)`: the same, plus a probe (a tiny object written and
  deleted, or the object read): a missing bucket, refused or missing
  credentials, or a store that does not answer are a `ConfigError` before any
  training starts.
* `write_with(path, write, what)`: `write(local_tmp)` writes a file that then
  replaces `path` whole (local: private temporary, fsync, rename; store: one
  upload); `replace_dir_with` for a directory (an export); `local_copy` to
  read one.

It sits below every layer (standard library, `stratkit.errors`,
`stratkit.files`; fsspec and the store's package imported when a URL is used).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator

from stratkit import files
from stratkit.errors import ConfigError
from stratkit.storage import clients
from stratkit.storage import errors as _errors
from stratkit.storage.errors import StoreError
from stratkit.storage.mirror import Mirror
from stratkit.storage.store import PROBE_PREFIX, Store, temporary_dir
from stratkit.storage.urls import SCHEMES, basename, is_url, join, local_path, redact, split

#: Seconds the start-up probe waits for a store (STRATKIT_STORE_TIMEOUT overrides).
PROBE_TIMEOUT = 60.0
TIMEOUT_VAR = "STRATKIT_STORE_TIMEOUT"


def _missing_package(scheme: str, what: str, path: str, exc: BaseException) -> ConfigError:
    known = SCHEMES.get(scheme)
    if known is None:
        return ConfigError(f"{what}={redact(path)!r}: the {scheme}:// filesystem is not available ({exc}). Fix: "
                           f"install the fsspec implementation for {scheme}://, or use s3://, gs://, az://, "
                           "hdfs:// or a local path")
    hint = (" (pyarrow reaches HDFS through libhdfs: it also needs Java and HADOOP_HOME, or ARROW_LIBHDFS_DIR)"
            if known.extra == "hdfs" else "")
    return ConfigError(f"{what}={redact(path)!r} needs the {scheme}:// filesystem ({known.package}), which is not "
                       f"installed{hint}. Fix: pip install \"stratkit[{known.extra}]\" (or pip install "
                       f"{known.package}) on every machine of the cluster")


def has_filesystem(path: str | os.PathLike[str]) -> bool:
    """Whether the filesystem `path` needs is installed: True for a local path or ``file://``, and for a URL
    whose fsspec implementation imports (s3fs for ``s3://``, ...); no I/O, nothing raised.

    Callers with a fallback of their own ask this first (Keras's own ``tf.io.gfile`` reaches ``gs://`` without
    gcsfs); everyone else calls `open_store`, whose `ConfigError` names the extra to install.
    """
    scheme, _ = split(os.fspath(path))
    if scheme is None or scheme == "file":
        return True
    known = SCHEMES.get(scheme)
    try:
        if known is not None:
            importlib.import_module(known.module)
        import fsspec

        fsspec.get_filesystem_class(known.protocol if known is not None else scheme)
    except (ImportError, ValueError):
        return False
    return True


def open_store(path: str | os.PathLike[str], what: str = "path") -> Store:
    """The `Store` for the directory or URL prefix `path` (no I/O on the store yet).

    Raises:
        ConfigError: the URL's filesystem is not installed (naming the extra), an unknown scheme, a
            ``file://`` URL of another host, or a local path that is a URL missing a slash (``s3:/b``).
    """
    text = os.fspath(path)
    local = local_path(text, what)
    if local is not None:
        return Store(local, None, local)
    scheme, rest = split(text)
    assert scheme is not None
    if not rest.strip("/"):
        raise ConfigError(f"{what}={redact(text)!r} names no bucket. Fix: {scheme}://<bucket>/<prefix>")
    known = SCHEMES.get(scheme)
    try:
        if known is not None:
            importlib.import_module(known.module)
        fs, root = clients.filesystem(text)
    except ImportError as exc:
        raise _missing_package(scheme, what, text, exc) from None
    except ValueError as exc:  # fsspec: "Protocol not known"
        raise _missing_package(scheme, what, text, exc) from None
    except Exception as exc:  # noqa: BLE001 - a backend that fails to start (e.g. libhdfs missing)
        if known is not None and known.extra == "hdfs":
            raise _missing_package(scheme, what, text, exc) from None
        error = _errors.translate(exc, "open", text)
        raise ConfigError(f"{what}={redact(text)!r}: {error}") from None
    return Store(text, fs, root)


def _deadline() -> float:
    raw = os.environ.get(TIMEOUT_VAR, "")
    try:
        return float(raw) if raw else PROBE_TIMEOUT
    except ValueError:
        raise ConfigError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds. Fix: e.g. {TIMEOUT_VAR}=60") from None


def _run_with_deadline(operation: Callable[[], None], seconds: float) -> BaseException | None:
    """Run `operation` in a daemon thread; its exception, a TimeoutError past `seconds`, or None."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            operation()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            outcome.append(exc)

    worker = threading.Thread(target=run, name="stratkit-store-probe", daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        return TimeoutError(f"no answer within {seconds:g} s")
    return outcome[0]


_FIXES = {
    _errors.DENIED: "check the credentials every machine of the cluster uses for this store (for S3 AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, for GCS GOOGLE_APPLICATION_CREDENTIALS, for Azure "
                    "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME/KEY), and that they may write here",
    _errors.NO_CREDENTIALS: "give every machine of the cluster credentials for this store (for S3 AWS_ACCESS_KEY_ID/"
                            "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, for GCS GOOGLE_APPLICATION_CREDENTIALS, for Azure "
                            "AZURE_STORAGE_CONNECTION_STRING)",
    _errors.UNREACHABLE: "check the store's endpoint (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, the Azure connection "
                         "string, or fsspec's FSSPEC_<PROTOCOL>_* settings) and that it is up and reachable",
    _errors.OTHER: "check the store, its endpoint and the credentials, or pass a local path",
}


def check_store(path: str | os.PathLike[str], what: str = "path", *, write: bool = True) -> Store:
    """`open_store(path)`, then prove the store answers: write and delete a probe object (or, with
    `write=False`, find `path`), within STRATKIT_STORE_TIMEOUT seconds (default 60).

    A local path is returned unprobed (the local checks of its user do that).

    Raises:
        ConfigError: as `open_store`; and a missing bucket or container, credentials refused or missing, a
            store that cannot be reached or does not answer in time, or (write=False) `path` missing.
    """
    store = open_store(path, what)
    if store.local:
        return store
    probe = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"

    def run() -> None:
        if write:
            store.write_bytes(probe, b"")
            store.remove(probe)
        elif not store.exists():
            raise FileNotFoundError(store.path())

    seconds = _deadline()
    failure = _run_with_deadline(run, seconds)
    if failure is None:
        return store
    shown = store.shown
    if isinstance(failure, TimeoutError) and "no answer within" in str(failure):
        raise ConfigError(f"{what}={shown!r}: the store did not answer within {seconds:g} s. Fix: "
                          f"{_FIXES[_errors.UNREACHABLE]} (or raise {TIMEOUT_VAR})")
    if isinstance(failure, FileNotFoundError):
        if not write:
            raise ConfigError(f"{what}={shown!r} does not exist. Fix: check the URL")
        bucket = shown.split("://", 1)[-1].split("/", 1)[0]
        raise ConfigError(f"{what}={shown!r}: the bucket or container {bucket!r} does not exist (or these "
                          f"credentials cannot see it). Fix: create it, or correct the URL")
    kind = failure.kind if isinstance(failure, StoreError) else _errors.kind_of(failure)
    raise ConfigError(f"{what}={shown!r}: {failure}. Fix: {_FIXES[kind]}")


# ------------------------------------------------------------------------------------------------
# A file or directory that lands whole where the user asked, local or remote
# ------------------------------------------------------------------------------------------------


def write_with(path: str | os.PathLike[str], write: Callable[[str], None], what: str = "path") -> str:
    """Replace the file `path` (local or URL) with what `write(tmp)` writes; returns `path` as given.

    `tmp` keeps `path`'s file name (Keras decides the format by the suffix). A
    local path goes through `stratkit.files.write_with` (private temporary,
    fsync, rename; the parent directories created); a URL is written to a local
    temporary and uploaded as one object. Either way nobody ever reads half a
    file, and nothing is left behind.

    A writer that makes more than the one file (Keras's sharded ``save_weights``
    writes ``name`` and its shards beside it; ``zipped=False`` makes ``name`` a
    directory) has every file it made uploaded, `path` itself last, so a reader
    that finds `path` finds the rest.
    """
    text = os.fspath(path)
    store_root = local_path(text, what)
    if store_root is not None:
        directory = os.path.dirname(os.path.abspath(store_root))
        os.makedirs(directory, exist_ok=True)

        def with_siblings(tmp: str) -> None:
            write(tmp)
            for entry in os.listdir(os.path.dirname(tmp)):    # a sharded save's shards: in place before `path`
                if entry != os.path.basename(tmp):
                    os.replace(os.path.join(os.path.dirname(tmp), entry), os.path.join(directory, entry))

        files.write_with(store_root, with_siblings)
        return text
    parent, name = text.rstrip("/").rsplit("/", 1)
    store = open_store(parent, what)
    scratch = temporary_dir("stratkit-upload-")
    try:
        tmp = os.path.join(scratch, name)
        write(tmp)
        _upload_made(store, scratch, name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return text


def _upload_made(store: Store, scratch: str, name: str) -> None:
    """Upload what a writer made in `scratch` for `name`: the files beside it first, `name` (a file, or a
    directory's files with a SavedModel's or a Keras directory's index last) last."""
    main = os.path.join(scratch, name)
    for entry in sorted(os.listdir(scratch)):
        source = os.path.join(scratch, entry)
        if entry != name and os.path.isfile(source):
            store.upload(source, entry)
        elif entry != name and os.path.isdir(source):
            store.upload_dir(source, entry)
    if os.path.isdir(main):
        store.upload_dir(main, name, last=("config.json", "saved_model.pb", "fingerprint.pb"))
    elif os.path.exists(main):
        store.upload(main, name)
    else:
        raise FileNotFoundError(f"the writer made no file {name!r} to upload to {store.path(name)}")


def replace_dir_with(path: str | os.PathLike[str], write: Callable[[str], None], what: str = "path",
                     last: tuple[str, ...] = ("saved_model.pb", "fingerprint.pb")) -> str:
    """Replace the directory `path` (local or URL) with the one `write(tmp_dir)` writes.

    Local: `stratkit.files.replace_dir_with` (the whole directory swapped in).
    A URL: every file uploaded, the names in `last` last (a SavedModel's
    ``saved_model.pb``: a loader that finds it finds its variables), then the
    objects the new directory does not hold are deleted.
    """
    text = os.fspath(path)
    root = local_path(text, what)
    if root is not None:
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        files.replace_dir_with(root, write)
        return text
    store = open_store(text, what)
    scratch = temporary_dir("stratkit-upload-")
    try:
        tmp = os.path.join(scratch, basename(text))
        write(tmp)
        store.upload_dir(tmp, "", last=last)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return text


@contextlib.contextmanager
def local_copy(path: str | os.PathLike[str], what: str = "path") -> Iterator[str]:
    """A local path holding the file or directory `path` names (a URL is downloaded for the block, then removed).

    For what Keras or TensorFlow cannot read from a store themselves::

        with stratkit.storage.local_copy("s3://bucket/run1/model.keras") as path:
            model = keras.models.load_model(path)

    A URL naming a prefix (an export, an unzipped ``.keras``) is downloaded as a directory.

    Raises:
        FileNotFoundError: nothing is stored at `path`.
    """
    text = os.fspath(path)
    root = local_path(text, what)
    if root is not None:
        yield root
        return
    parent, name = text.rstrip("/").rsplit("/", 1)
    store = open_store(parent, what)
    scratch = temporary_dir("stratkit-download-")
    try:
        target = os.path.join(scratch, name)
        try:
            store.download(name, target)
        except FileNotFoundError:
            if not store.download_dir(name, target):   # a prefix: a directory's files
                raise
        yield target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


__all__ = ["PROBE_PREFIX", "PROBE_TIMEOUT", "SCHEMES", "Mirror", "Store", "StoreError", "check_store",
           "has_filesystem", "is_url", "join", "local_copy", "local_path", "open_store", "redact",
           "replace_dir_with", "write_with"]
