"""The ``ropekit`` command line: ``ropekit <verb> [options]``.

Verbs: ``inspect`` (a config's rotary frequencies, pair by pair), ``decay`` (RoFormer's long-term
decay bound), ``report`` (an HTML page with figures and live checks), ``bench`` (speed table),
``convert``, ``train``, ``extrapolate`` and ``probe`` (how a pretrained model uses its rotary
pairs). Each verb is a module of :mod:`ropekit.cli`: its
``add_parser`` builds the arguments without torch, its ``run`` does the work with the library or the
lab. Arguments are parsed before torch is imported (``--help`` and ``--version`` never import it).

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
  (:func:`ropekit.files.raise_if_interrupted`), and a verb that returns after it still ends 130;
- anything else is a bug and keeps Python's traceback (exit 1): ``KeyError``, ``AttributeError``,
  ``RuntimeError``, a ``ValueError`` raised inside torch or by a builtin such as ``int("x")``, an
  ``OSError`` on one of ropekit's own files.

Output folders and files a verb declares (``--out``, ``decay --png``) are checked before the verb
runs (:mod:`ropekit.cli.outputs`); an output folder the run created is removed again when the
run fails or is interrupted and the folder is still empty.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from .. import files
from .errors import Parser, UserError, user_error_message
from .outputs import prepared_outputs

#: The verbs, in the order ``ropekit --help`` lists them: each is the module ``ropekit.cli.<verb>``.
VERBS = ("inspect", "decay", "report", "bench", "convert", "train", "extrapolate", "probe")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per verb (no verb module imports torch at import)."""
    from .. import __version__

    parser = Parser(prog="ropekit", description="Rotary Position Embedding toolkit.")
    parser.add_argument("--version", action="version", version=f"ropekit {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="<verb>")
    for verb in VERBS:
        importlib.import_module(f"{__package__}.{verb}").add_parser(verbs)
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


def _run(argv: list[str]) -> int:
    """Parse, run the verb and turn how it ended into the exit code (the module docstring's rule)."""
    verb = _verb_in(argv)
    args = None
    try:
        args = build_parser().parse_args(argv)
        with prepared_outputs(args):
            code = args.func(args)
            files.raise_if_interrupted()  # an interrupt dropped by Python on the way still ends the run
            return code
    except KeyboardInterrupt:
        print(f"{'ropekit ' + verb if verb else 'ropekit'}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`ropekit inspect ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except (UserError, ValueError, TypeError, OSError) as exc:
        message = None if args is None else user_error_message(exc, args)
        if message is None:
            raise
        print(f"ropekit {args.verb}: error: {message}", file=sys.stderr)
        return 2

