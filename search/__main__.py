"""Entry point of ``python -m search``."""

import sys

from search.views.cli import main

if __name__ == "__main__":
    sys.exit(main())
