"""``python -m pstrain.cli``: the ``pstrain`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
