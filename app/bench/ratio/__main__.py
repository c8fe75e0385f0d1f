"""``python -m app.bench.ratio``: what ``scripts/bench_ratio.sh`` runs."""

import sys

from app.bench.ratio.cli import main

if __name__ == "__main__":
    sys.exit(main())
