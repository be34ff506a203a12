"""How a ``ropekit`` run ends: which failures are the user's (one line, exit 2) and which are bugs.

The rule (``ropekit.cli.entry`` applies it to every verb; its docstring says it for users): a
failure is the user's when it is a usage error, a :class:`UserError`, a ``ValueError``,
``TypeError`` or ``OSError`` raised by a ``raise`` statement in ropekit's own code or in the package
that provides the verb (the lab's ``ropekit_lab``: deliberate validation, whose message names the
argument, what was expected and what was given), or an
``OSError`` about a path the user named, a file inside it or a folder on the way to it. Anything
else, e.g. a ``ValueError`` raised by ``int("x")`` or inside torch, or a ``KeyError``, is a bug
and keeps its traceback. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the blanks around them) replaced by single spaces."""
    return re.sub(r"\s*\n\s*", " ", text.strip())


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``ropekit <verb>: error: ... (see ... --help)``."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ropekit package


def _verb_package_dir(args: argparse.Namespace) -> str | None:
    """The folder of the top-level package whose module runs the verb (``ropekit_lab`` for the lab's verbs)."""
    top = str(getattr(getattr(args, "func", None), "__module__", None) or "").split(".")[0]
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if top and path else None


def _raised_by_ropekit(exc: BaseException, args: argparse.Namespace | None = None) -> bool:
    """Whether ``exc`` comes from a ``raise`` statement in ropekit's code or the verb's package (not a builtin)."""
    import dis

    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    own = [_PACKAGE_DIR] + ([] if args is None else [d for d in [_verb_package_dir(args)] if d])
    if not any(os.path.abspath(code.co_filename).startswith(folder + os.sep) for folder in own):
        return False
    return any(i.offset == tb.tb_lasti and i.opname == "RAISE_VARARGS" for i in dis.get_instructions(code))


def _names_user_path(exc: OSError, args: argparse.Namespace) -> bool:
    """Whether ``exc`` is about a path argument, something inside it, or a folder on the way to it."""
    given = [os.path.abspath(v) for dest, value in vars(args).items() if dest != "verb"
             for v in (value if isinstance(value, list) else [value]) if isinstance(v, (str, os.PathLike))]
    for name in (exc.filename, exc.filename2):
        if isinstance(name, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(name))
            if any(os.path.commonpath([path, user]) in (path, user) for user in given):
                return True
    return False


def user_error_message(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The one-line message for a user-input error (rule in the module docstring); ``None`` for a bug."""
    if isinstance(exc, UserError) or (isinstance(exc, (ValueError, TypeError, OSError))
                                      and _raised_by_ropekit(exc, args)):
        return one_line(str(exc) or type(exc).__name__)
    if isinstance(exc, OSError) and _names_user_path(exc, args):
        where = " -> ".join(repr(os.fsdecode(n)) for n in (exc.filename, exc.filename2) if n is not None)
        return one_line(f"{exc.strerror or type(exc).__name__}: {where}")
    return None
