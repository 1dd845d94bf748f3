"""Durable file writes, checksums and advisory locks: the only place bytes hit disk.

`write_file_durably` is the single function that writes bytes, so tests can monkeypatch it to simulate
ENOSPC. Readers of a file written by `atomic_write` see the old or the new file, never half of one; readers of a
directory put in place by `replace_dir` see the old or the new directory, never files of both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
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


def staging_dir(out: Path) -> Path:
    """A fresh, empty sibling of ``out`` to write a whole directory into before ``replace_dir`` puts it in place
    (same file system, so the rename is atomic). A staging folder a killed run left behind is removed first."""
    out = Path(out)
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def aside_dir(out: Path) -> Path:
    return Path(out).with_name(f".{Path(out).name}.old")


def replace_dir(new: Path, out: Path) -> None:
    """Put the complete directory ``new`` at ``out`` in one step, then remove the old ``out`` (if any).

    Linux: ``renameat2(RENAME_EXCHANGE)`` swaps the two names atomically. Elsewhere: ``out`` is renamed aside,
    ``new`` renamed in, the aside removed; a kill between the two renames leaves ``out`` missing and the old
    directory complete at ``aside_dir(out)``, where ``restore_dir`` finds it.
    """
    new, out = Path(new), Path(out)
    restore_dir(out)
    if not out.exists():
        os.replace(new, out)
    elif _exchange(new, out):  # `new` now names the old directory
        fsync_dir(out.parent)
        shutil.rmtree(new, ignore_errors=True)
        return
    else:
        aside = aside_dir(out)
        os.replace(out, aside)
        os.replace(new, out)
        fsync_dir(out.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    fsync_dir(out.parent)


def carry_over(old: Path, new: Path, skip: set[str]) -> None:
    """The other files of ``old`` (a README, notes) into ``new`` before ``replace_dir`` swaps the directories.
    Hard links where the file system allows (no bytes copied), copies elsewhere."""
    for p in old.iterdir():
        if p.name in skip:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, new / p.name)


def _link_or_copy(src, dst) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def restore_dir(out: Path) -> None:
    """Finish what a killed ``replace_dir`` left: the old directory back at ``out`` when ``out`` is missing, or
    the aside copy removed when the new one is in place."""
    aside = aside_dir(out)
    if not aside.is_dir():
        return
    if not Path(out).exists():
        os.replace(aside, out)
        fsync_dir(Path(out).parent)
    else:
        shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the file system or kernel cannot exchange: the two-rename route
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def process_temp_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory named after this process, removed on exit; the ones processes that are gone left
    behind (a kill -9 or SIGTERM runs no cleanup) are removed first. A live process's directory is left alone."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{prefix}*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
        for _ in range(100):  # a holder that removes the file as it releases (release(remove=True)): open again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                held = e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)
                why = "" if held else f": {e.strerror or e}"  # flock's EAGAIN text says nothing a user can use
                raise LockHeld(f"another process holds {what} ({self.path}){why}; wait for it to finish") from e
            if _same_file(fd, self.path):
                self._fd = fd
                return
            os.close(fd)  # locked a file its holder removed meanwhile: that lock guards nothing
        raise LockHeld(f"{self.path} keeps being replaced; another process is taking {what}")

    def release(self, remove: bool = False) -> None:
        """``remove``: delete the lock file first, while still holding it (a finished run leaves no file);
        a process that opened the old file before finds it gone and opens again."""
        if self._fd is not None:
            if remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
