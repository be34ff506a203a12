"""Writing outputs so that a reader never sees half of one: the tools' one way to write a file or a directory.

Every output is built inside a *staging directory*: a hidden directory
``.ropekit-staging-<random hex>`` beside the target, created by this process and held under an
exclusive ``flock`` for as long as it exists. Only a complete output leaves it, with one rename:

* a file with :func:`os.replace` (readers see the old file or the new one);
* a directory with an atomic exchange (``renameat2(RENAME_EXCHANGE)`` on Linux), so the target is
  always the old directory or the new one; where the system cannot exchange, the old directory is
  first renamed into the staging directory and the new one renamed into place (the target is then
  briefly absent, never a mix).

Files are created inside the staging directory (never with ``mkstemp``) and given the mode any
other file gets, ``0o666 & ~umask``, whatever the library that wrote them chose; they are
flushed to disk (``fsync``) before the rename. On an error the staging directory is removed.

A run killed by a signal or a power cut cannot remove its staging directory, but it no longer
holds its lock: every later write into the same directory removes staging directories that carry
ropekit's name and marker file (or are empty) and whose lock is free
(:func:`remove_stale_staging`). Nothing else is ever deleted.

:func:`fs_step` is called before each step that changes the file system; tests replace it to stop
a run at every step.

An interrupt Python could not deliver (Ctrl-C arriving while a weakref or ``__del__`` callback runs
is printed as "Exception ignored" and dropped) still stops an output from appearing: the command
line's SIGINT handler records it (:func:`note_interrupt`) before raising, and every final rename
first calls :func:`raise_if_interrupted`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so leftovers are never provably stale and never removed
    fcntl = None

STAGING_PREFIX = ".ropekit-staging-"
#: file inside every staging directory: with the name and a free lock, the proof that it is a leftover
MARKER = ".ropekit-staging"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_interrupted = False  # a SIGINT was received (see note_interrupt)


def note_interrupt() -> None:
    """Record that the user interrupted the run (called by the command line's SIGINT handler)."""
    global _interrupted
    _interrupted = True


def clear_interrupt() -> None:
    """Forget a recorded interrupt (a new command line run in the same process starts clean)."""
    global _interrupted
    _interrupted = False


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt was recorded, even one Python dropped on the way."""
    if _interrupted:
        raise KeyboardInterrupt


def fs_step(action: str, path: Path) -> None:
    """Called before every change to the file system (``action`` on ``path``); does nothing.

    Tests replace it to interrupt a run at each step (an exception or a real ``SIGKILL``).
    """


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to disk; silently skipped where a directory cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; ``False`` if another process holds it."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging directories in ``parent`` left by runs that died; return what was removed.

    Only a directory named ``.ropekit-staging-*`` whose lock no live process holds and that holds
    the marker file (or nothing at all: a run killed right after creating it) is removed; anything
    else, a run in progress included, is left alone.
    """
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if _try_lock(fd) and (os.path.isfile(os.path.join(entry.path, MARKER)) or not os.listdir(entry.path)):
                fs_step("remove stale", Path(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _create_locked(parent: Path) -> tuple[Path, int]:
    """A new staging directory in ``parent``, locked and marked: ``(path, fd holding the lock)``."""
    for _ in range(3):
        stage = parent / f"{STAGING_PREFIX}{secrets.token_hex(8)}"
        fs_step("mkdir", stage)
        os.mkdir(stage)
        try:
            fd = os.open(stage, os.O_RDONLY)
        except FileNotFoundError:  # another run's cleanup took it while it was empty and unlocked
            continue
        try:
            _try_lock(fd)
            (stage / MARKER).write_bytes(b"")
            return stage, fd
        except FileNotFoundError:
            os.close(fd)
    raise OSError(f"could not create a staging directory in {parent}")


@contextmanager
def staging_directory(parent: str | Path) -> Iterator[Path]:
    """A fresh, locked, hidden directory in the existing directory ``parent``; removed on exit.

    Stale staging directories of killed runs in ``parent`` are removed first.
    """
    parent = Path(parent)
    remove_stale_staging(parent)
    stage, fd = _create_locked(parent)
    try:
        yield stage
    finally:
        try:
            fs_step("remove", stage)
            shutil.rmtree(stage, ignore_errors=True)
        finally:
            os.close(fd)  # the lock goes with it: whatever is left is a leftover for the next run


def current_umask() -> int:
    """The process umask, read without changing it where the system says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """Create ``path`` (inside a staging directory) by calling ``write(path)``, then flush it to disk.

    The file gets mode ``0o666 & ~umask`` like any file a program creates, whatever the writer did
    (``safetensors`` creates its files ``0o600``).
    """
    fs_step("write", path)
    write(path)
    os.chmod(path, 0o666 & ~current_umask())
    _fsync(path)


def make_directory(path: Path) -> None:
    """Create the directory ``path`` (inside a staging directory); its mode follows the umask."""
    fs_step("mkdir", path)
    os.mkdir(path)


def replace_file(new: Path, path: Path) -> None:
    """Move the finished file ``new`` onto ``path`` in one :func:`os.replace`."""
    raise_if_interrupted()
    fs_step("replace", path)
    os.replace(new, path)
    _fsync(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2``); ``False`` where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fs_step("exchange", b)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_directory(new: Path, path: Path) -> None:
    """Move the finished directory ``new`` (inside a staging directory) to ``path``.

    An existing ``path`` is exchanged with ``new`` atomically where the system can, else renamed
    into the staging directory first; either way the old content ends up in the staging directory,
    which removes it.
    """
    raise_if_interrupted()
    if os.path.lexists(path):
        if not _exchange(new, path):
            fs_step("retire", path)
            os.rename(path, new.with_name(new.name + ".old"))
            fs_step("rename", path)
            os.rename(new, path)
    else:
        fs_step("rename", path)
        os.rename(new, path)
    _fsync(path.parent)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` by calling ``write(tmp)`` on a path in a staging directory, then :func:`os.replace`.

    For writers that take a path (``safetensors.torch.save_file``, ``torch.save``). On any error
    (the disk full, an interrupt) nothing is left behind and ``path`` is as it was. The directory
    of ``path`` must exist.
    """
    path = Path(path)
    with staging_directory(path.parent) as stage:
        tmp = stage / path.name
        write_file(tmp, write)
        replace_file(tmp, path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all-or-nothing (see :func:`write_atomic`); the mode follows the umask."""
    write_atomic(path, lambda tmp: tmp.write_bytes(data))
