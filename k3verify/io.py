"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Write to a temp file in the destination directory (same filesystem, so the rename
is atomic), fsync it, then os.replace over the target. A crash or exception at any
point leaves the previous file untouched and no temp file behind.

The new file gets the mode a plain open(path, "w") would give it (0o666 less the
process umask, so 0644 under the usual 022): mkstemp alone creates 0600, which hid
reports from every other user of the machine.

An OSError while writing (read-only directory, a path under a regular file, disk
full) becomes WriteError: still an OSError, and a UsageError so the CLI prints one
line and exits 2. check_writable_dir / check_writable_file refuse such a location
before a run starts, so a long run does not die at its end.

Reading is bounded: read_json / loads_toml (optimized_stack.safe_load, here with
ReadError) refuse nesting deeper than 64 levels, integers over 300 digits and bytes that
are not UTF-8 in one line naming the file, where Python's parsers would raise a
RecursionError or the 4,300-digit ValueError. Every k3verify reader of a JSON or TOML file
uses them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from optimized_stack import safe_load

from k3verify.errors import UsageError


class ReadError(UsageError):
    """A file outside the readers' bounds (too deep, a huge integer, not UTF-8). Not a
    ValueError, so a caller's `except ValueError` (a file cut short) does not hide it."""


def read_json(path: str | os.PathLike, source: str | None = None) -> object:
    """The JSON in a file, bounded (ReadError); OSError and json.JSONDecodeError pass through."""
    return safe_load.read_json(path, source, error=ReadError)


def loads_toml(text: str, source: str) -> dict:
    """tomllib.loads, bounded (ReadError); tomllib.TOMLDecodeError passes through."""
    return safe_load.loads_toml(text, source, error=ReadError)


class WriteError(OSError, UsageError):
    """A file could not be written; the message names the file and the system's reason."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace path with data atomically; parent directories are created. Returns the path."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes expects bytes, got {type(data).__name__}")
    target = Path(path)
    try:
        _replace(target, data)
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(f"cannot write {target}: {_reason(exc, target)}") from exc
    return target


def _replace(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(target, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a stray temp file next to the target.
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


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


def make_dir(path: str | os.PathLike) -> Path:
    """mkdir -p, with WriteError (one line, exit 2) instead of FileExistsError / PermissionError."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"cannot create directory {p}: {_reason(exc, p)}") from exc
    return p


def process_umask() -> int:
    """The umask without changing it: /proc/self/status on Linux, else set-and-restore."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)   # the only portable read; restored at once
    os.umask(mask)
    return mask


def check_writable_dir(path: str | os.PathLike, what: str = "--report-dir") -> None:
    """Refuse, before any work, a directory a run could not create or write into.

    Probes with a real temp file in the directory (or its nearest existing ancestor, where
    it would be created) rather than os.access: that also holds for root, for read-only
    mounts and for ACLs. Writes nothing that stays."""
    p = Path(path)
    problem = f"expected a directory, got a {_kind(p)}" if p.exists() and not p.is_dir() else _dir_problem(p)
    problem = problem or output_dir_problem(p)       # dangling symlink, too little free space (end of file)
    if problem:
        raise UsageError(f"{what} {p}: {problem}")


def check_writable_file(path: str | os.PathLike, what: str = "--out") -> None:
    """Refuse, before any work, a file path that could not be written (a directory, an unwritable parent)."""
    p = Path(path)
    problem = "expected a file path, got a directory" if p.is_dir() else _dir_problem(p.parent)
    if problem:
        raise UsageError(f"{what} {p}: {problem}")


def _dir_problem(p: Path) -> str | None:
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a {_kind(probe)}, not a directory"
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".k3verify-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"cannot write in {probe} ({exc.strerror or exc})"
    return None


def _kind(p: Path) -> str:
    return "regular file" if p.is_file() else "special file"


def _reason(exc: OSError, target: Path) -> str:
    blocker = next((p for p in target.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():      # mkdir's "File exists" / "Not a directory"
        return f"{blocker} is a {_kind(blocker)}, not a directory"
    reason = exc.strerror or str(exc)
    if exc.filename is not None and Path(os.fsdecode(exc.filename)) != target:
        reason += f" ({os.fsdecode(exc.filename)})"
    return reason


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


# ---- output locations: what a run checks before any work, and the report's set of files ----------

MIN_FREE_BYTES = 16 * 1024 * 1024     # a report set with plots and a run's checks files fit in far less


def output_dir_problem(p: Path) -> str | None:
    """Why a run could not write under directory `p` that a temp-file probe does not see, or None:
    a dangling symlink on the way (mkdir would fail at the end of the run), or a filesystem with
    less than MIN_FREE_BYTES free (a full disk that would cut the report short)."""
    probe = p
    while True:
        if probe.is_symlink() and not probe.exists():
            return f"{probe} is a symlink to {os.readlink(probe)}, which does not exist"
        if probe.exists() or probe == probe.parent:
            break
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return None                      # no answer is not a refusal: the probe write already ran
    if free < MIN_FREE_BYTES:
        return (f"only {free / 2**20:.1f} MiB free on its filesystem ({probe}); a run needs at least "
                f"{MIN_FREE_BYTES // 2**20} MiB")
    return None


def _write_temp(target: Path, data: bytes) -> str:
    """data in a fsynced temp file beside target (same filesystem, so a rename replaces it); its path."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_set(files: "dict[Path, bytes]") -> list[Path]:
    """Replace several files as one set: every new file is written to a temp file first, then all
    are renamed in the given order. If any write fails (a full disk, a read-only directory), no
    file of the set is replaced; if a rename fails, the ones already renamed are put back from
    hard-link backups of the old files. A reader sees the complete old set or the complete new one,
    and no temp file is left behind. Raises WriteError naming the file."""
    targets = [Path(t) for t in files]
    temps: dict[Path, str] = {}
    backups: dict[Path, str] = {}
    renamed: list[Path] = []
    current = targets[0] if targets else Path(".")
    try:
        for target, data in zip(targets, files.values()):
            current = target
            target.parent.mkdir(parents=True, exist_ok=True)
            temps[target] = _write_temp(target, bytes(data))
        for target in targets:                       # the old set, kept until the new one is in place
            current = target
            if target.exists():
                backup = tempfile.mktemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old")
                try:
                    os.link(target, backup)
                except OSError:
                    shutil.copy2(target, backup)
                backups[target] = backup
        for target in targets:
            current = target
            os.replace(temps[target], target)
            del temps[target]                        # renamed: no temp left to clean up
            renamed.append(target)
    except BaseException as exc:
        for target in reversed(renamed):             # undo: the old file back, or no file where none was
            if target in backups:
                os.replace(backups.pop(target), target)
            else:
                target.unlink(missing_ok=True)
        for tmp in [*temps.values(), *backups.values()]:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(f"cannot write {current}: {_reason(exc, current)}; no file of the set "
                             f"was replaced") from exc
        raise
    for backup in backups.values():
        Path(backup).unlink(missing_ok=True)
    for d in dict.fromkeys(t.parent for t in targets):
        _fsync_dir(d)
    return targets
