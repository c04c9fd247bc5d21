"""Which writer a path a Keras user gave goes through: the local disk, stratkit's store layer, or Keras's own.

Keras 3 sends any ``scheme://`` path through ``tf.io.gfile``, which in
TensorFlow 2.21 reaches ``gs://`` (and ``ram://``) only. Where stratkit
writes a user's path itself (`model.save` & co. under its save guards, the
callbacks it routes: for a model under a stratkit strategy, at any world size),
the one rule is:

* a local path, or ``file://`` + an absolute path: the local disk (a path
  that reads as a URL missing a slash, ``s3:/bucket``, is refused: it would
  become a directory named ``s3:``);
* a URL whose fsspec filesystem is installed (s3fs, gcsfs, adlfs, pyarrow):
  the store layer (`stratkit.storage`), so ``s3://`` and ``az://`` work
  although TensorFlow cannot reach them;
* a URL that fsspec cannot open but ``tf.io.gfile`` can (``gs://`` without
  gcsfs): left to Keras, exactly as plain Keras writes it;
* anything else: the store layer's `ConfigError`, naming the extra to install.
"""

from __future__ import annotations

import functools
import os

from stratkit import storage

LOCAL, STORE, KERAS = "local", "store", "keras"


@functools.cache
def _gfile_schemes() -> frozenset[str]:
    import tensorflow as tf

    return frozenset(tf.io.gfile.get_registered_schemes())


def route(path: str | os.PathLike[str], what: str) -> str:
    """`LOCAL`, `STORE` or `KERAS`: who writes `path` (see the module's docstring).

    Raises:
        ConfigError: a URL neither fsspec nor ``tf.io.gfile`` can open (naming the extra), an unknown
            scheme, a ``file://`` URL of another host, or a local path that is a URL missing a slash.
    """
    text = os.fspath(path)
    if not storage.is_url(text):
        storage.local_path(text, what)
        return LOCAL
    if storage.has_filesystem(text):
        return STORE
    scheme = text.split("://", 1)[0].lower()
    if scheme in _gfile_schemes():
        return KERAS
    storage.open_store(text, what)     # raises the ConfigError that names what to install
    return STORE


def local(path: str | os.PathLike[str], what: str) -> str:
    """The local path `path` names (a ``file://`` URL without its scheme); `path` must be `LOCAL`."""
    text = os.fspath(path)
    found = storage.local_path(text, what)
    return text if found is None else found


__all__ = ["KERAS", "LOCAL", "STORE", "local", "route"]
