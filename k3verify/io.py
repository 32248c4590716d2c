"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Write to a temp file in the destination directory (same filesystem, so the rename
is atomic), fsync it, then os.replace over the target. A crash or exception at any
point leaves the previous file untouched and no temp file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace path with data atomically; parent directories are created. Returns the path."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes expects bytes, got {type(data).__name__}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a stray temp file next to the target.
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return target


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text expects str, got {type(text).__name__}")
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: object, indent: int | None = 2, allow_nan: bool = True) -> Path:
    """Serialize fully before touching the file, so an unserializable object changes nothing.

    allow_nan=False refuses NaN/Infinity, which strict JSON parsers reject.
    """
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=allow_nan) + "\n"
    return atomic_write_text(path, text)


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself; not supported on every platform, where it is skipped."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
