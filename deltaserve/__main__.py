"""`python -m deltaserve ...`: the same as the `deltaserve` command."""

from __future__ import annotations

import sys

from deltaserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
