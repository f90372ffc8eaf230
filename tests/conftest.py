"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflash import KVFlashError


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """The real default model (SmolLM2-135M-Instruct GGUF), fetched into the user cache on first use."""
    from kvflash.models.fetch import default_model_path

    try:
        return default_model_path(fetch=True)
    except KVFlashError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free 127.0.0.1 port, its files in the test's temp dir (the test is
    skipped, saying why, where Debian's redis-server is not installed)."""
    from tests.redis_util import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def store(tmp_path):
    """A snapshot store in the test's temp dir, with two read workers."""
    from kvflash.storage import SnapshotStore

    st = SnapshotStore(tmp_path / "store", workers=2)
    yield st
    st.close()
