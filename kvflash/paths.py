"""Where kvflash keeps its files: one root, overridable so tests and CI can use a scratch dir."""

from __future__ import annotations

import os
import tempfile
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


def write_whole(path: Path, text: str) -> None:
    """Written to a temporary file beside `path`, then renamed into place: a crash leaves the previous
    file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".part")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
