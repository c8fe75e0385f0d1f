"""``python -m app.bench.loadgen``: the same as ``ai-backend bench``."""

import sys

from app.bench.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
