"""``python -m app.bench.limit``: the same as ``ai-backend limit`` (what the bench scripts run)."""

import sys

from app.bench.limit.cli import main

if __name__ == "__main__":
    sys.exit(main())
