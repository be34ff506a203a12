"""The ``ropekit`` command line: ``ropekit <verb> [options]``.

The library's verbs: ``inspect`` (a config's rotary frequencies, pair by pair), ``decay`` (RoFormer's
long-term decay bound) and ``convert`` (a checkpoint between the two layouts), each a module of
:mod:`ropekit.cli`. Other distributions add verbs through the entry-point group ``ropekit.verbs``
(:data:`VERB_GROUP`): the lab (``ropekit-lab``) adds ``report``, ``bench``, ``train``,
``extrapolate`` and ``probe``; without it, naming one of those ends in one line saying how to install
it (exit 2). A verb module's ``add_parser`` builds the arguments without torch, its ``run`` does the
work. Arguments are parsed before torch is imported (``--help`` and ``--version`` never import it).

How a run ends, whatever the verb (:func:`main` applies the rule, the verbs do not):

- exit 0, or 1 for a report whose live checks fail;
- exit 2 and one line ``ropekit <verb>: error: <message>`` on stderr for bad input: a usage error
  (argparse), a :class:`UserError`, a ``ValueError``/``TypeError``/``OSError`` raised by a
  ``raise`` statement in ropekit's own code (the library's validation, whose messages name the
  argument, what was expected and what was given), and an ``OSError`` on a path the user named
  (that path, a file inside it, or a folder on the way to it: permission denied, disk full, ...);
- exit 130 and ``ropekit <verb>: interrupted`` on Ctrl-C, also when the ``KeyboardInterrupt``
  was raised inside a callback Python ignores exceptions of (a weakref or ``__del__`` callback):
  the SIGINT handler records the interrupt, no output is moved into place after it
  (:func:`ropekit.files.raise_if_interrupted`), a verb that returns after it still ends 130, and so
  does one that fails with any other exception after it (Ctrl-C during an import leaves the module
  half-loaded, and the next import of it raises ``ImportError``);
- anything else is a bug and keeps Python's traceback (exit 1): ``KeyError``, ``AttributeError``,
  ``RuntimeError``, a ``ValueError`` raised inside torch or by a builtin such as ``int("x")``, an
  ``OSError`` on one of ropekit's own files.

The modules a verb declares it needs (:mod:`ropekit.cli.requirements`) are checked first: a missing
one is one line naming it and the ``pip install`` to run, exit 2. Output folders and files a verb
declares (``--out``, ``decay --png``) are checked next, before the verb runs
(:mod:`ropekit.cli.outputs`); an output folder the run created is removed again when the run fails
or is interrupted and the folder is still empty.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import Any

from .. import files
from .errors import Parser, UserError, user_error_message
from .outputs import prepared_outputs
from .requirements import LAB_INSTALL, check_requirements

#: The library's verbs, in the order ``ropekit --help`` lists them: each is the module ``ropekit.cli.<verb>``.
VERBS = ("inspect", "decay", "convert")
#: The entry-point group through which an installed distribution adds verbs: ``name = "package.module"``,
#: a module with ``add_parser(verbs)`` and ``run(args)`` as the library's verb modules have.
VERB_GROUP = "ropekit.verbs"
#: The verbs the lab (``ropekit-lab``) adds, in the order ``ropekit --help`` lists them after the library's.
LAB_VERBS = ("report", "bench", "train", "extrapolate", "probe", "extend")


def installed_verbs() -> dict[str, Any]:
    """The verbs installed distributions add: ``{name: entry point}`` of the group :data:`VERB_GROUP`.

    Reads installed metadata only (nothing is imported). A library verb's name is never taken over;
    the lab's verbs come first, in :data:`LAB_VERBS` order, then any other by name.
    """
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for point in entry_points(group=VERB_GROUP):
        if point.name not in VERBS and point.name not in found:
            found[point.name] = point
    order = [v for v in LAB_VERBS if v in found] + sorted(v for v in found if v not in LAB_VERBS)
    return {name: found[name] for name in order}


def build_parser(plugins: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per verb (no verb module imports torch at import).

    ``plugins``: the verbs of other distributions (default :func:`installed_verbs`), each loaded here.
    """
    from .. import __version__

    plugins = installed_verbs() if plugins is None else plugins
    missing_lab = [verb for verb in LAB_VERBS if verb not in plugins]
    parser = Parser(prog="ropekit", description="Rotary Position Embedding toolkit.",
                    epilog=f"The lab's verbs are not installed: {LAB_INSTALL}." if missing_lab else None)
    parser.add_argument("--version", action="version", version=f"ropekit {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="<verb>")
    for verb in VERBS:
        importlib.import_module(f"{__package__}.{verb}").add_parser(verbs)
    for point in plugins.values():
        point.load().add_parser(verbs)
    return parser


# -- how a run ends ----------------------------------------------------------------------------------


def _verb_in(argv: list[str]) -> str | None:
    """The verb of a command line (the first word that is not an option), before parsing."""
    return next((word for word in argv if not word.startswith("-")), None)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: record it (an exception raised inside a callback would be dropped), then raise."""
    files.note_interrupt()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ropekit`` console script and ``python -m ropekit``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if in_main_thread else None
    files.clear_interrupt()
    try:
        return _run(argv)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _interrupted(verb: str | None) -> int:
    """Say the run was interrupted; the exit code 130."""
    print(f"{'ropekit ' + verb if verb else 'ropekit'}: interrupted", file=sys.stderr)
    return 130


def _run(argv: list[str]) -> int:
    """Parse, run the verb and turn how it ended into the exit code (the module docstring's rule)."""
    verb = _verb_in(argv)
    plugins = installed_verbs()
    if verb in LAB_VERBS and verb not in plugins:
        print(f"ropekit {verb}: error: {verb} is a verb of the lab, which is not installed: {LAB_INSTALL}",
              file=sys.stderr)
        return 2
    args = None
    try:
        args = build_parser(plugins).parse_args(argv)
        check_requirements(args)  # before any folder is created or any work begins
        with prepared_outputs(args):
            code = args.func(args)
            files.raise_if_interrupted()  # an interrupt dropped by Python on the way still ends the run
            return code
    except KeyboardInterrupt:
        return _interrupted(verb)
    except BrokenPipeError:  # the reader of stdout went away (`ropekit inspect ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except Exception as exc:
        if files.was_interrupted():  # the interrupt broke something on its way (an import it cut short)
            return _interrupted(verb)
        user_kind = isinstance(exc, (UserError, ValueError, TypeError, OSError))
        message = None if args is None or not user_kind else user_error_message(exc, args)
        if message is None:
            raise
        print(f"ropekit {args.verb}: error: {message}", file=sys.stderr)
        return 2

