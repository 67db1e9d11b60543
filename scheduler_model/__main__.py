"""``python -m scheduler_model`` — see :mod:`scheduler_model.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
