"""Symbolic links in a source directory: followed only when they stay inside it (or inside its Hugging Face cache).

``ropekit convert`` reads the weights of a model directory and copies its other files into the
output. A link among them that leads out of the directory (``tokenizer.json -> ~/.ssh/id_ed25519``,
``/etc/shadow``) would copy a file the user never chose, into an output others may read; such a
link is refused with a one-line ``ValueError`` before anything is written. Two kinds of link are
followed:

* a link whose target, all links resolved, lies inside the source directory;
* the Hugging Face cache's own layout: the files of ``<cache>/models--org--name/snapshots/<rev>/``
  link to ``../../blobs/<hash>`` of the same repository folder.

:func:`open_source` opens the checked target without following a link and returns its permission
bits, so that a copy never gets more than its source had.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: the folder names of the Hugging Face cache: <repo type>s--<org>--<name>/snapshots/<revision>/
_CACHE_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _cache_blobs(real_directory: str) -> str | None:
    """``<repo>/blobs`` when ``real_directory`` is ``<repo>/snapshots/<rev>`` of a Hugging Face cache, else ``None``."""
    snapshots = os.path.dirname(real_directory)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith(_CACHE_REPO_PREFIXES):
        return None
    return os.path.join(repo, "blobs")


def checked_target(path: Path, directory: Path) -> Path:
    """The real path of ``path`` (a file of the source ``directory``); ``ValueError`` if a link leads out of it.

    See the module docstring for the links that are followed.
    """
    real_directory = os.path.realpath(directory)
    real = os.path.realpath(path)
    if _inside(real, real_directory):
        return Path(real)
    blobs = _cache_blobs(real_directory)
    if blobs is not None and _inside(real, blobs) and real != blobs:
        return Path(real)
    raise ValueError(f"SRC file {str(path)!r} is a symbolic link to {real!r}, outside SRC {str(directory)!r}; "
                     "refusing to read or copy it (copy the file into SRC if it belongs to the model)")


def open_source(path: Path, directory: Path) -> tuple[int, int]:
    """Open the file ``path`` of ``directory`` for reading: ``(fd, permission bits)``; the caller closes ``fd``.

    The target is checked by :func:`checked_target` and opened without following a link, so a
    link swapped after the check is not followed either; anything but a regular file is refused.
    """
    real = checked_target(path, directory)
    fd = os.open(real, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError(f"SRC file {str(path)!r} is not a regular file; refusing to copy it")
    return fd, stat.S_IMODE(info.st_mode) & 0o777
