"""Output folders and files of the command-line verbs: checked before the work, tidied after a failure.

A verb declares its outputs on its parser (:func:`add_out_argument`, :func:`declare_output_file`);
``ropekit.cli.entry`` then calls :func:`prepared_outputs` around the verb, so that every verb

- fails in a fraction of a second, before importing torch or computing anything, when an output
  cannot be written: a ``--out`` that is a file, that lies under a file, or whose folder refuses a
  new file (permissions, a read-only file system); an output file that is a device, a named pipe
  or a socket (``--png /dev/null``), which a tool never replaces;
- leaves no empty folder behind when it fails or is interrupted: the folders it created are
  removed again if they hold nothing; a folder that existed before is never touched.

Writability is tested by creating (and removing) a hidden temporary file: permission bits say
nothing for root, and a read-only mount refuses root too. Torch-free, like the argument parsers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..files import check_not_special

_DIRS, _FILES = "output_dirs", "output_files"  # parser defaults naming the output arguments (dest, option)


def add_out_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--out DIR`` (default ``./<default>``) and declare it as the verb's output folder."""
    parser.add_argument("--out", metavar="DIR", default=default, help=f"output directory (default ./{default})")
    parser.set_defaults(**{_DIRS: (("out", "--out"),)})


def declare_output_file(parser: argparse.ArgumentParser, dest: str, option: str) -> None:
    """Declare the argument ``dest`` (spelled ``option``) as an output file: its folder must exist and take files."""
    parser.set_defaults(**{_FILES: (*(parser.get_default(_FILES) or ()), (dest, option))})


def _probe(directory: Path, option: str, shown: str) -> None:
    """Create and remove a hidden file in ``directory``; ``ValueError`` naming ``option`` if that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".ropekit-probe-", dir=directory)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{option} {shown!r} is not writable: cannot create a file in {str(directory)!r} "
                         f"({reason})") from None
    os.close(fd)
    os.unlink(name)


def check_output_file(path: str, option: str) -> None:
    """``path``: not a folder, device, pipe or socket; its folder must exist and take a new file; else ValueError."""
    check_not_special(path, option)
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} must be a file path, got the directory {path!r}")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path!r}: directory does not exist: {str(parent)!r}")
    _probe(parent, option, path)


def _missing_folders(target: Path, option: str, shown: str) -> list[Path]:
    """The folders from ``target`` up to its first existing ancestor, deepest first (``[]`` if it exists)."""
    missing, current = [], target
    while not current.exists():
        if current.is_symlink():  # a dangling link: mkdir would fail on it
            raise ValueError(f"{option} {shown!r}: {str(current)!r} is a broken symbolic link")
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    if not current.is_dir():
        what = "is" if current == target else "lies under"
        raise ValueError(f"{option} must be a directory: {shown!r} {what} the file {str(current)!r}")
    return missing


@contextmanager
def output_directory(path: str, option: str = "--out") -> Iterator[Path]:
    """Check that ``path`` is, or can be created as, a writable folder; create it and yield it as a Path.

    Raises ``ValueError`` (naming ``option``, the path and the reason) before anything is created
    when ``path`` is a file, lies under one, or its first existing folder does not accept a new file.
    When the body raises, ``KeyboardInterrupt`` included, the folders created here are removed,
    deepest first, as long as they are empty.
    """
    target = Path(path)
    missing = _missing_folders(target, option, path)
    _probe(target if not missing else missing[-1].parent, option, path)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path!r}: cannot create the directory ({exc.strerror or exc})") from None
    try:
        yield target
    except BaseException:
        remove_empty(missing)
        raise


def remove_empty(folders: list[Path]) -> None:
    """``rmdir`` each folder in order (deepest first) while it is empty; stop at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (something of value), or already gone
            return


@contextmanager
def prepared_outputs(args: argparse.Namespace) -> Iterator[None]:
    """Check the outputs a verb's parser declared, create its output folders, tidy them if the body fails."""
    for dest, option in getattr(args, _FILES, None) or ():
        if getattr(args, dest, None) is not None:
            check_output_file(getattr(args, dest), option)
    with ExitStack() as stack:
        for dest, option in getattr(args, _DIRS, None) or ():
            stack.enter_context(output_directory(getattr(args, dest), option))
        yield
