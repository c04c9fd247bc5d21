"""Fixtures for the storage layer's tests: a store's client settings in this process."""

from __future__ import annotations

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

    refresh = stores.refresh_clients   # read the settings again: fsspec's config, no cached filesystem
    use.refresh = refresh

    yield use
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved)
    for cls in stores._filesystem_classes():
        cls.clear_instance_cache()
