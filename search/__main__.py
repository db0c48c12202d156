"""Entry point of ``python -m search``."""

import sys

from search._cli import main

if __name__ == "__main__":
    sys.exit(main())
