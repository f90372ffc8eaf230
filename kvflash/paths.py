"""Where kvflash keeps its files: one root, overridable so tests and CI can use a scratch dir."""

from __future__ import annotations

import os
from pathlib import Path


def kvflash_home() -> Path:
    """$KVFLASH_HOME, else ~/.cache/kvflash."""
    env = os.environ.get("KVFLASH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvflash"


def models_dir() -> Path:
    """Downloaded model files."""
    return kvflash_home() / "models"


def snapshots_dir() -> Path:
    """The default snapshot store."""
    return kvflash_home() / "snapshots"
