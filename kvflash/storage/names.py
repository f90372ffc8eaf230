"""The text the store accepts from callers. Only chunk hashes and snapshot ids ever become part of a
path or a key, and both are fixed-length lowercase hex, so nothing a user types can leave the store."""

from __future__ import annotations

import re
import secrets

from kvflash.storage.errors import InvalidName

HASH_HEX = 64
SNAPSHOT_ID_HEX = 12
MAX_LABEL = 200
MAX_FINGERPRINT = 64

_HASH = re.compile(rf"[0-9a-f]{{{HASH_HEX}}}")
_ID = re.compile(rf"[0-9a-f]{{{SNAPSHOT_ID_HEX}}}")
_FINGERPRINT = re.compile(rf"[0-9A-Za-z_.:+-]{{1,{MAX_FINGERPRINT}}}")


def is_hash(value: object) -> bool:
    return isinstance(value, str) and _HASH.fullmatch(value) is not None


def check_hash(value: object) -> str:
    if not is_hash(value):
        raise InvalidName(f"not a chunk hash (64 lowercase hex digits): {value!r:.80}")
    return value


def check_snapshot_id(value: object) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidName(f"not a snapshot id ({SNAPSHOT_ID_HEX} lowercase hex digits): {value!r:.80}")
    return value


def check_fingerprint(value: object) -> str:
    if not isinstance(value, str) or not _FINGERPRINT.fullmatch(value):
        raise InvalidName(f"not a model fingerprint (1-{MAX_FINGERPRINT} of [0-9A-Za-z_.:+-]): {value!r:.80}")
    return value


def check_label(value: object) -> str:
    """Labels are free text kept only in the index; control characters (NUL included) are refused so a
    label prints on one line and survives any tool that treats NUL as a terminator."""
    if not isinstance(value, str) or len(value) > MAX_LABEL:
        raise InvalidName(f"a label is text of at most {MAX_LABEL} characters: {value!r:.80}")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise InvalidName(f"a label may not contain control characters: {value!r:.80}")
    return value


def new_snapshot_id() -> str:
    return secrets.token_hex(SNAPSHOT_ID_HEX // 2)
