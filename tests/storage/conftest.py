"""Fixtures for the storage layer's tests: a store's client settings in this process."""

from __future__ import annotations

import os

import pytest
import stores


@pytest.fixture
def use_store(monkeypatch, store_server):
    """`use_store(scheme)` -> the running server, with its client settings in os.environ and in fsspec's
    config (which fsspec reads from FSSPEC_* once, at import) for this test only."""
    import fsspec.config

    saved = {k: dict(v) for k, v in fsspec.config.conf.items()}

    def use(scheme: str) -> stores.StoreServer:
        server = store_server(scheme)
        for name in stores.CLEARED:
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        refresh()
        return server

    def refresh() -> None:
        """Read the settings again: fsspec's config, and no filesystem cached with the old credentials."""
        fsspec.config.conf.clear()
        fsspec.config.set_conf_env(fsspec.config.conf, os.environ)
        for cls in _filesystems():
            cls.clear_instance_cache()

    use.refresh = refresh

    yield use
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved)
    for cls in _filesystems():
        cls.clear_instance_cache()


def _filesystems() -> list:
    import fsspec

    out = []
    for protocol in ("s3", "gs", "az"):
        try:
            out.append(fsspec.get_filesystem_class(protocol))
        except (ImportError, ValueError):
            pass
    return out
