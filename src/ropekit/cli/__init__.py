"""The ``ropekit`` command line: one module per verb (``ropekit.cli.<verb>``), run by :func:`main`.

Arguments are parsed before torch is imported (``--help`` and ``--version`` never import it): a verb
module builds its parser with ``add_parser`` and imports the library or the lab in ``run``. How a
run ends (exit codes, one-line errors) is one rule, in :mod:`.main`.
"""

from .entry import main
from .errors import UserError

__all__ = ["UserError", "main"]
