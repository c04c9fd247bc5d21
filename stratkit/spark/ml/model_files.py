"""Model files in and out: the one place a path or URL becomes bytes, and the check that bytes are a Keras model.

Every file the Spark ML stages read or write (a saved stage's `model.keras`
and pickled params, the model file `keras_predict` scores with) goes through
`read_file` / `write_file`, which go through the store layer
(`stratkit.storage`): a plain path or a file:// URL is a file of this
machine, written atomically; s3://, gs://, az://, hdfs:// are objects,
uploaded whole (a missing filesystem package is a `ConfigError` naming the
extra to install).

A bare path is a path of the driver's filesystem, not of Spark's default
filesystem: on a cluster whose `fs.defaultFS` is HDFS, save stages to a URL
(hdfs://..., s3://...) that Spark and stratkit both reach.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

from stratkit import storage
from stratkit.errors import ConfigError

#: The fix for a file that is not a Keras 3 model file.
SAVE_AS_KERAS = "Fix: save the model with model.save('model.keras') (Keras 3) and pass that file"


def join(directory: str, name: str) -> str:
    """`directory/name` for a path or a URL."""
    return storage.join(str(directory), name)


def _store_and_name(url: str, what: str) -> tuple[storage.Store, str]:
    parent, _, name = str(url).rstrip("/").rpartition("/")
    return storage.open_store(parent or ".", what), name


def read_file(url: str, what: str = "path") -> bytes:
    """The bytes of the file at `url` (a path or a URL).

    Raises:
        FileNotFoundError: there is no such file.
    """
    local = storage.local_path(url, what)
    if local is not None:
        with open(local, "rb") as handle:
            return handle.read()
    store, name = _store_and_name(url, what)
    return store.read_bytes(name)


def write_file(url: str, data: bytes, what: str = "path") -> None:
    """Write `data` to `url`, creating its directory: a reader sees the old file or the new one, never half."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            handle.write(data)

    storage.write_with(url, write, what)


def exists(url: str, what: str = "path") -> bool:
    local = storage.local_path(url, what)
    if local is not None:
        return os.path.exists(local)
    store, name = _store_and_name(url, what)
    return store.exists(name)


def check_keras_archive(data: bytes, where: str) -> dict:
    """Refuse bytes that are not a Keras 3 `.keras` file; return its metadata.json (keras_version, ...).

    Args:
        data: the file's bytes.
        where: how the user named it, for the message (a path, "the fitted model").

    Raises:
        ConfigError: naming the file, what it is instead, and the fix.
    """
    if data[:4] == b"\x89HDF":
        raise ConfigError(f"{where} is an HDF5 file (a legacy Keras .h5 model or .weights.h5 weights), not a Keras 3 "
                          f".keras model file. {SAVE_AS_KERAS}")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise ConfigError(f"{where} is not a Keras model file (a .keras file is a zip archive holding config.json, "
                          f"metadata.json and the weights; this is {len(data)} bytes of something else). {SAVE_AS_KERAS}")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        missing = [n for n in ("config.json", "metadata.json") if n not in names]
        if missing:
            raise ConfigError(f"{where} is a zip archive without {' and '.join(missing)}, so not a Keras model file. "
                              f"{SAVE_AS_KERAS}")
        try:
            return json.loads(archive.read("metadata.json"))
        except ValueError:
            raise ConfigError(f"{where} has an unreadable metadata.json: not a Keras model file. {SAVE_AS_KERAS}") from None


def read_model(url: str, what: str = "model") -> bytes:
    """The bytes of the Keras model file at `url`, checked (`check_keras_archive`).

    Raises:
        ConfigError: no such file, a directory (a SavedModel), or not a Keras model file.
    """
    local = storage.local_path(url, what)
    if local is not None and os.path.isdir(local):
        raise ConfigError(f"{what}={url!r} is a directory (a TensorFlow SavedModel?), not a Keras .keras model file. "
                          "Fix: save the model with model.save('model.keras') and pass that file")
    try:
        data = read_file(url, what)
    except FileNotFoundError:
        raise ConfigError(f"{what}={url!r}: no such file. Fix: pass the path (or URL) of a .keras model file the "
                          "driver can read") from None
    check_keras_archive(data, f"{what}={url!r}")
    return data
