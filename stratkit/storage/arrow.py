"""Which pyarrow filesystem reads a path or URL: pyarrow's own where it is faster, fsspec's otherwise.

The table reader (`stratkit.data`) reads Parquet row groups and byte ranges through a
`pyarrow.fs.FileSystem`. For S3 pyarrow's native client (the AWS C++ SDK) reads the same Parquet file
about 3x faster than s3fs through pyarrow's fsspec handler (measured against moto on this machine,
docs/data.md "Cost"; arrow #34414 reports 16 s against minutes on real S3), so S3 uses it, with the same
settings the store layer's fsspec gets from the environment: the endpoint from `AWS_ENDPOINT_URL`
(`AWS_ENDPOINT_URL_S3`, fsspec's `FSSPEC_S3_ENDPOINT_URL`), the region from `AWS_REGION` /
`AWS_DEFAULT_REGION`, the credentials as the AWS SDK finds them (`AWS_ACCESS_KEY_ID`/..., a profile). An
fsspec configuration with more than an endpoint (keys in `FSSPEC_S3`, a config file) is honoured by reading
through fsspec instead. Every other store (GCS, Azure, HDFS, any fsspec protocol) is read through its fsspec
filesystem (`open_store`'s), wrapped for pyarrow; `STRATKIT_LAKE_FILESYSTEM=fsspec` makes S3 do the same.

Imports pyarrow and the store's package when called (the floor: no stratkit layer).
"""

from __future__ import annotations

import os
from typing import Any

from stratkit.errors import ConfigError
from stratkit.storage.urls import local_path, redact, split

#: "arrow" (default: pyarrow's own S3 client where it applies) or "fsspec" (always fsspec).
FILESYSTEM_VAR = "STRATKIT_LAKE_FILESYSTEM"


def _s3_settings() -> dict[str, Any] | None:
    """pyarrow S3FileSystem arguments from the environment, or None when fsspec's configuration says more."""
    import fsspec.config

    conf = {k: v for k, v in fsspec.config.conf.get("s3", {}).items()}
    endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or conf.pop("endpoint_url", None) or (conf.get("client_kwargs") or {}).get("endpoint_url"))
    client_kwargs = dict(conf.pop("client_kwargs", None) or {})
    client_kwargs.pop("endpoint_url", None)
    region = client_kwargs.pop("region_name", None)
    if conf or client_kwargs:
        return None  # keys, a profile or options in fsspec's configuration: fsspec reads them
    settings: dict[str, Any] = {"region": region or os.environ.get("AWS_REGION")
                                or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if endpoint:
        scheme, rest = split(endpoint)
        settings["endpoint_override"] = rest.rstrip("/") if scheme else endpoint
        settings["scheme"] = scheme or "https"
    return settings


def arrow_filesystem(path: str | os.PathLike[str], what: str = "path") -> tuple[Any, str]:
    """(pyarrow filesystem, the path as it names it) for a local path or a store URL.

    Raises:
        ConfigError: as `stratkit.storage.open_store` (a missing package, an unknown scheme, ...).
    """
    import pyarrow.fs as pafs

    text = os.fspath(path)
    local = local_path(text, what)
    if local is not None:
        return pafs.LocalFileSystem(), os.path.abspath(local)
    scheme, rest = split(text)
    choice = os.environ.get(FILESYSTEM_VAR, "arrow").strip().lower() or "arrow"
    if choice not in ("arrow", "fsspec"):
        raise ConfigError(f"{FILESYSTEM_VAR}={choice!r} is not 'arrow' or 'fsspec'. Fix: unset it (pyarrow's S3 "
                          "client for s3://, fsspec for the rest), or set it to 'fsspec'")
    if scheme in ("s3", "s3a") and choice == "arrow":
        settings = _s3_settings()
        if settings is not None:
            try:
                return pafs.S3FileSystem(**settings), rest.strip("/")
            except Exception as exc:  # noqa: BLE001 - said as a ConfigError naming the URL
                raise ConfigError(f"{what}={redact(text)!r}: pyarrow's S3 client could not start ({exc}). Fix: "
                                  f"check AWS_ENDPOINT_URL and the credentials, or set {FILESYSTEM_VAR}=fsspec") \
                    from None
    from stratkit.storage import open_store

    store = open_store(text, what)
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.fs)), store.root


__all__ = ["FILESYSTEM_VAR", "arrow_filesystem"]
