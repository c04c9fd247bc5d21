"""Model files in and out: the one place a path or URL becomes bytes, and the check that bytes are a Keras model.

Every file the Spark ML stages read or write (a saved stage's `model.keras`
and pickled params, the model file `keras_predict` scores with) goes through
`read_file` / `write_file`. Until stratkit has a storage layer, a plain path
or a file:// URL is a file of this machine (written atomically through
`stratkit.files`), and any other URL (hdfs://, s3://, gs://, ...) goes
through pyarrow's filesystems, as the DataFrame staging does
(`stratkit.spark.data`); routing both through a storage layer is a change
here only.

A bare path is a path of the driver's filesystem, not of Spark's default
filesystem: on a cluster whose `fs.defaultFS` is HDFS, save stages to a URL
(hdfs://..., s3://...) that Spark and stratkit both read.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

from stratkit import files
from stratkit.errors import ConfigError
from stratkit.spark.data import _filesystem  # the URL -> pyarrow filesystem rule of the staging

#: The fix for a file that is not a Keras 3 model file.
SAVE_AS_KERAS = "Fix: save the model with model.save('model.keras') (Keras 3) and pass that file"


def join(directory: str, name: str) -> str:
    """`directory/name` for a path or a URL."""
    return f"{str(directory).rstrip('/')}/{name}"


def _local(url: str) -> str | None:
    if "://" not in url and not url.startswith("file:"):
        return os.path.abspath(os.path.expanduser(url))
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    return None


def read_file(url: str) -> bytes:
    """The bytes of the file at `url` (a path or a URL).

    Raises:
        FileNotFoundError: there is no such file.
    """
    local = _local(url)
    if local is not None:
        with open(local, "rb") as handle:
            return handle.read()
    filesystem, path = _filesystem(url)
    from pyarrow import fs

    if filesystem.get_file_info(path).type == fs.FileType.NotFound:
        raise FileNotFoundError(url)
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def write_file(url: str, data: bytes) -> None:
    """Write `data` to `url`, creating its directory: a reader sees the old file or the new one, never half."""
    local = _local(url)
    if local is not None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        files.write_bytes(local, data)
        return
    filesystem, path = _filesystem(url)
    filesystem.create_dir(path.rpartition("/")[0], recursive=True)
    # Object stores publish an object whole when its upload completes; HDFS readers wait for the close.
    with filesystem.open_output_stream(path) as stream:
        stream.write(data)


def exists(url: str) -> bool:
    local = _local(url)
    if local is not None:
        return os.path.exists(local)
    filesystem, path = _filesystem(url)
    from pyarrow import fs

    return filesystem.get_file_info(path).type != fs.FileType.NotFound


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
    local = _local(url)
    if local is not None and os.path.isdir(local):
        raise ConfigError(f"{what}={url!r} is a directory (a TensorFlow SavedModel?), not a Keras .keras model file. "
                          "Fix: save the model with model.save('model.keras') and pass that file")
    try:
        data = read_file(url)
    except FileNotFoundError:
        raise ConfigError(f"{what}={url!r}: no such file. Fix: pass the path (or URL) of a .keras model file the "
                          "driver can read") from None
    check_keras_archive(data, f"{what}={url!r}")
    return data
