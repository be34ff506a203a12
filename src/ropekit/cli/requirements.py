"""What a verb needs installed besides ropekit, checked before any work: one line and the ``pip install`` to run.

A verb declares the modules it needs on its parser (:func:`declare_requirements`, optionally only
when an option is given, as ``decay --png``); ``ropekit.cli.entry`` checks them
(:func:`check_requirements`) after parsing and before the output folders are created or anything
is imported or computed. A missing module ends the run with exit code 2 and one line naming the
module and the command that installs it (an extra of ropekit, or the lab). Torch-free.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterable

from .errors import UserError

__all__ = ["LAB_INSTALL", "MissingModule", "check_requirements", "declare_requirements", "installed", "require"]

#: How to install the lab (the ``ropekit-lab`` distribution, which provides the lab's verbs and their dependencies).
LAB_INSTALL = "pip install ropekit-lab (in a clone of ropekit: pip install ./lab)"

_REQUIRES = "required_modules"  # parser default: ((modules, install, when option dest or None), ...)


class MissingModule(UserError):
    """A module a verb needs is not installed: the message names it and the ``pip install`` to run."""


def installed(module: str) -> bool:
    """Whether ``module`` (a top-level name such as ``"matplotlib"``) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a half-imported module
        return False


def require(modules: Iterable[str], install: str) -> None:
    """Raise :class:`MissingModule` naming the first of ``modules`` that is not installed and ``install``.

    Args:
        modules: top-level module names (``"safetensors"``, ``"matplotlib"``).
        install: the command that provides them, e.g. ``"pip install 'ropekit[convert]'"``.
    """
    missing = [name for name in modules if not installed(name)]
    if missing:
        names = " and ".join(repr(name) for name in missing)
        raise MissingModule(f"needs the module{'s' if len(missing) > 1 else ''} {names}, not installed: {install}")


def declare_requirements(parser: argparse.ArgumentParser, modules: Iterable[str], install: str, *,
                         when: str | None = None) -> None:
    """Declare that the verb of ``parser`` needs ``modules`` (only when the option with dest ``when`` is given)."""
    entry = (tuple(modules), install, when)
    parser.set_defaults(**{_REQUIRES: (*(parser.get_default(_REQUIRES) or ()), entry)})


def check_requirements(args: argparse.Namespace) -> None:
    """Check every requirement the parsed verb declared; :class:`MissingModule` for the first one unmet."""
    for modules, install, when in getattr(args, _REQUIRES, None) or ():
        if when is None or getattr(args, when, None) not in (None, False):
            require(modules, install)
