"""Durable file writes, checksums and advisory locks: the only place bytes hit disk.

`write_file_durably` is the single function that writes bytes, so tests can monkeypatch it to simulate
ENOSPC. Readers of a file written by `atomic_write` see the old or the new file, never half of one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path

from draftsmith.core.errors import DraftsmithError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, single writer is on the user
    fcntl = None  # type: ignore[assignment]


class LockHeld(DraftsmithError):
    """Another process holds the lock; rerunning while it runs cannot help."""


def write_file_durably(path: Path, data: bytes) -> None:
    """Write and fsync `path`; the caller renames it into place afterwards."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Persist a rename: without this, a power cut can forget the new directory entry."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError as e:  # pragma: no cover - some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def atomic_write(path: Path, data: bytes) -> None:
    """temp file + fsync + os.replace + directory fsync: readers see the old or the new file, never half."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        write_file_durably(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: Path, chunk: int = 4 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ExclusiveLock:
    """An advisory lock on `path` (created if missing), held until `release()` or process exit.

    Closing the descriptor releases the flock, so a killed process never leaves a stale lock behind.
    """

    def __init__(self, path: Path, what: str):
        self.path = Path(path)
        self._fd: int | None = None
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            held = e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)
            why = "" if held else f": {e.strerror or e}"  # flock's EAGAIN text says nothing a user can use
            raise LockHeld(f"another process holds {what} ({self.path}){why}; wait for it to finish") from e
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
