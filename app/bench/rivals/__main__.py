"""``python -m app.bench.rivals {litserve,fastapi,ray} ...``: serve the model the way a rival does."""

from __future__ import annotations

import sys

RIVALS = ("litserve", "fastapi", "ray")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in RIVALS:
        print(f"usage: python -m app.bench.rivals {{{','.join(RIVALS)}}} --repository R [options]", file=sys.stderr)
        return 2
    if argv[0] == "litserve":
        from app.bench.rivals.litserve_rival import main as serve
    elif argv[0] == "ray":
        from app.bench.rivals.ray_rival import main as serve
    else:
        from app.bench.rivals.fastapi_rival import main as serve
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
