"""The ``ropekit`` command line: one module per verb (``ropekit.cli.<verb>``), run by :func:`main`.

Arguments are parsed before torch is imported (``--help`` and ``--version`` never import it): a verb
module builds its parser with ``add_parser`` and imports the library in ``run``. How a run ends
(exit codes, one-line errors) is one rule, in :mod:`.entry`. Other distributions add verbs through
the entry-point group ``ropekit.verbs`` (the lab, ``ropekit-lab``, adds ``report``, ``bench``,
``train``, ``extrapolate`` and ``probe``); the names below are what such a verb module builds on:
its arguments (:func:`config_arguments`, :func:`positive`, :func:`at_least`), its outputs
(:func:`add_out_argument`, :func:`declare_output_file`), what it needs installed
(:func:`declare_requirements`), and its errors (:class:`UserError`). Torch-free.
"""

from .common import at_least, config_arguments, load_config, number, one_thread, positive, print_json
from .entry import LAB_VERBS, VERB_GROUP, main
from .errors import UserError
from .outputs import add_out_argument, declare_output_file
from .requirements import LAB_INSTALL, MissingModule, declare_requirements, require

__all__ = [
    "LAB_INSTALL",
    "LAB_VERBS",
    "VERB_GROUP",
    "MissingModule",
    "UserError",
    "add_out_argument",
    "at_least",
    "config_arguments",
    "declare_output_file",
    "declare_requirements",
    "load_config",
    "main",
    "number",
    "one_thread",
    "positive",
    "print_json",
    "require",
]
