"""Which fsspec filesystem a store URL gets: one per store and per client settings, not one per process.

fsspec keeps one filesystem per protocol and arguments for the life of the process, and its client reads
the environment (endpoint, credentials, region, fsspec's configuration) once, when it first connects. In a
process that lives on (a notebook, a tuning host, a Spark driver), a user who fixes AWS_SECRET_ACCESS_KEY or
points AWS_ENDPOINT_URL at another store, as stratkit's own errors tell them to, was answered by the old client:
the same "refused the credentials" again, or objects written to the old endpoint.

So the store layer keeps its own filesystems, keyed by the process, the URL's scheme and authority (bucket,
container) and the settings a client reads: the stores' SDK variables (``AWS_*``, ``GOOGLE_*``,
``STORAGE_EMULATOR_HOST``, ``AZURE_*``, ...) and fsspec's configuration for the protocol. The same settings
reuse the filesystem (and its open connections); changed settings make a new one. A credentials *file* that
changes under the same variables is not seen (fsspec's behaviour, kept).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from stratkit.storage.urls import SCHEMES, split

#: Environment variables that a store's client reads (the AWS SDK, google-auth/gcsfs, azure-identity/adlfs,
#: libhdfs, fsspec's own FSSPEC_*).
_SETTINGS_PREFIXES = ("AWS_", "BOTO_", "GOOGLE_", "GCS", "GCLOUD", "CLOUDSDK_", "STORAGE_EMULATOR_HOST", "AZURE_",
                      "AZURITE", "FSSPEC_", "HADOOP_", "ARROW_LIBHDFS", "KRB5")

_lock = threading.Lock()
_filesystems: dict[tuple[Any, ...], Any] = {}


def _settings(protocol: str) -> tuple[Any, ...]:
    import fsspec.config

    variables = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS_PREFIXES)))
    return variables, repr(sorted(fsspec.config.conf.get(protocol, {}).items()))


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for the store URL `url`, made with the settings in force now.

    Raises what fsspec raises for a URL it cannot serve (ImportError, ValueError, a backend's own error).
    """
    import fsspec.core

    scheme, rest = split(url)
    known = SCHEMES.get(scheme or "")
    protocol = known.protocol if known is not None else (scheme or "")
    key = (os.getpid(), scheme, rest.split("/", 1)[0], _settings(protocol))
    with _lock:
        fs = _filesystems.get(key)
    if fs is not None:
        return fs, fsspec.core.strip_protocol(url)
    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False, skip_instance_cache=True)
    with _lock:
        for old in [k for k in _filesystems if k[:3] == key[:3] or k[0] != key[0]]:
            del _filesystems[old]   # the same store under older settings (or a parent process's): not used again
        _filesystems[key] = fs
    return fs, root


__all__ = ["filesystem"]
