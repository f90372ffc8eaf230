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
