"""``python -m ropekit``: the command line, the same as the ``ropekit`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
