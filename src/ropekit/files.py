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
other file gets, ``0o666 & ~umask`` (or less: a copy never gets more than its source's permission
bits), whatever the library that wrote them chose; they are flushed to disk (``fsync``) before the
rename. On an error the staging directory is removed.

In a folder other people may write (a shared group folder, umask ``002``) nothing they plant can
redirect a write:

* the staging directory is created ``0o700`` and checked to be this user's directory, not a link,
  so that no one else can add an entry to it until the final rename;
* every file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a descriptor of its directory
  (``os.open(name, ..., dir_fd=fd)``): an entry that is already there, a symbolic link above all,
  is an error, never followed; its mode is set through a descriptor opened ``O_NOFOLLOW``;
* the final rename replaces the target's directory entry and never writes through it; a target
  that is a device, a named pipe or a socket is refused (:class:`SpecialFileError`), never replaced.

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
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so leftovers are never provably stale and never removed
    fcntl = None

__all__ = [
    "MARKER",
    "STAGING_PREFIX",
    "SpecialFileError",
    "check_not_special",
    "clear_interrupt",
    "current_umask",
    "file_kind",
    "fs_step",
    "make_directory",
    "note_interrupt",
    "raise_if_interrupted",
    "remove_stale_staging",
    "replace_directory",
    "replace_file",
    "staging_directory",
    "write_atomic",
    "write_bytes_atomic",
    "write_file",
]

STAGING_PREFIX = ".ropekit-staging-"
#: file inside every staging directory: with the name and a free lock, the proof that it is a leftover
MARKER = ".ropekit-staging"
_AT_FDCWD = -100
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
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


def was_interrupted() -> bool:
    """Whether an interrupt was recorded since :func:`clear_interrupt`."""
    return _interrupted


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt was recorded, even one Python dropped on the way."""
    if _interrupted:
        raise KeyboardInterrupt


def fs_step(action: str, path: Path) -> None:
    """Called before every change to the file system (``action`` on ``path``); does nothing.

    Tests replace it to interrupt a run at each step (an exception or a real ``SIGKILL``).
    """


class SpecialFileError(ValueError):
    """An output path names a device, a named pipe or a socket: a tool never replaces one."""


def file_kind(mode: int) -> str:
    """``"character device"``, ``"named pipe"``, ... for an ``st_mode``: the words messages use."""
    kinds = ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "named pipe"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"))
    return next((name for test, name in kinds if test(mode)), "regular file")


def check_not_special(path: str | Path, option: str = "output") -> None:
    """``SpecialFileError`` if ``path`` exists (not followed if a link) and is not a file, directory or link.

    ``option`` names the argument in the message (``"--png"``, ``"DST"``).
    """
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        raise SpecialFileError(f"{option} {str(path)!r} is a {file_kind(mode)}, not a regular file or directory; "
                               "refusing to replace it (--force never replaces one either)")


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

    Only a directory named ``.ropekit-staging-*`` that this user owns, whose lock no live process
    holds and that holds the marker file (or nothing at all: a run killed right after creating it)
    is removed; anything else, a run in progress or another user's directory included, is left alone.
    """
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
        except OSError:
            continue
        try:
            marked = os.path.isfile(os.path.join(entry.path, MARKER)) or not os.listdir(entry.path)
            if _owned_by_me(fd) and _try_lock(fd) and marked:
                fs_step("remove stale", Path(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _owned_by_me(fd: int) -> bool:
    """Whether the open file ``fd`` belongs to this process's effective user."""
    return not hasattr(os, "geteuid") or os.fstat(fd).st_uid == os.geteuid()


def _open_private_directory(stage: Path) -> int:
    """Open the just-created ``stage``; check it is this user's directory, not a link, and make it ``0o700``.

    Raises ``OSError`` when someone else's entry took its place (another user may rename entries
    in a shared folder): nothing is then written into it.
    """
    fd = os.open(stage, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or not _owned_by_me(fd) or os.lstat(stage).st_ino != info.st_ino:
            raise OSError(errno.EPERM, "staging directory replaced by another user's entry", str(stage))
        os.fchmod(fd, 0o700)  # whatever the umask: private until the final rename
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_locked(parent: Path) -> tuple[Path, int]:
    """A new private (``0o700``) staging directory in ``parent``, locked and marked: ``(path, fd holding the lock)``."""
    for _ in range(3):
        stage = parent / f"{STAGING_PREFIX}{secrets.token_hex(8)}"
        fs_step("mkdir", stage)
        os.mkdir(stage, 0o700)
        try:
            fd = _open_private_directory(stage)
        except FileNotFoundError:  # another run's cleanup took it while it was empty and unlocked
            continue
        try:
            _try_lock(fd)
            os.close(os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=fd))
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


def _create_new(path: Path) -> None:
    """Create the empty file ``path`` (``0o600``) without following a link: ``FileExistsError`` if anything is there."""
    directory = os.open(path.parent, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        os.close(os.open(path.name, flags, 0o600, dir_fd=directory))
    finally:
        os.close(directory)


def _finish(path: Path, mode: int) -> None:
    """Give the written file ``path`` its ``mode`` and flush it, through a descriptor that did not follow a link."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise OSError(errno.EPERM, f"the writer left a {file_kind(kind)}, not a regular file", str(path))
        os.fchmod(fd, mode)
        try:
            os.fsync(fd)
        except OSError:
            pass
    finally:
        os.close(fd)


def write_file(path: Path, write: Callable[[Path], None], *, mode_limit: int = 0o666) -> None:
    """Create ``path`` (inside a staging directory) by calling ``write(path)``, then flush it to disk.

    ``path`` is first created empty with ``O_EXCL | O_NOFOLLOW`` (see the module docstring), so
    ``write`` fills a new regular file of this user. The file gets mode ``0o666 & ~umask`` like any
    file a program creates, whatever the writer did (``safetensors`` creates its files ``0o600``),
    and no permission bit that ``mode_limit`` lacks (a copy passes its source's bits).
    """
    fs_step("write", path)
    _create_new(path)
    write(path)
    _finish(path, 0o666 & ~current_umask() & mode_limit)


def make_directory(path: Path) -> None:
    """Create the directory ``path`` (inside a staging directory); its mode follows the umask."""
    fs_step("mkdir", path)
    os.mkdir(path)


def replace_file(new: Path, path: Path) -> None:
    """Move the finished file ``new`` onto ``path`` in one :func:`os.replace`.

    ``path`` may be missing, a file or a symbolic link (the link itself is replaced, never what it
    names); a device, named pipe or socket is refused (:class:`SpecialFileError`).
    """
    raise_if_interrupted()
    check_not_special(path)
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
    which removes it. A ``path`` that exists and is not a directory (or a link) is refused:
    :class:`SpecialFileError` for a device, named pipe or socket, ``NotADirectoryError`` for a file.
    """
    raise_if_interrupted()
    check_not_special(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "refusing to replace a file with a directory", str(path))
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
    of ``path`` must exist; a ``path`` that is a device, named pipe or socket is refused before
    anything is written (:class:`SpecialFileError`).
    """
    path = Path(path)
    check_not_special(path)
    with staging_directory(path.parent) as stage:
        tmp = stage / path.name
        write_file(tmp, write)
        replace_file(tmp, path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all-or-nothing (see :func:`write_atomic`); the mode follows the umask."""
    write_atomic(path, lambda tmp: tmp.write_bytes(data))
