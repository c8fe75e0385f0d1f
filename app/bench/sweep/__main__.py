"""``python -m app.bench.sweep``: the same as ``ai-backend sweep``."""

import sys

from app.bench.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
