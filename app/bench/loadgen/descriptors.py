"""The client's own file descriptors: one per connection in flight, within the process's limit.

Many shells start with a soft ``RLIMIT_NOFILE`` of 1024. Past it every new connection fails in
the client (``EMFILE``), and those failures read as the server's errors. So the soft limit is
raised to the hard one at start. A closed loop that needs more connections than that leaves (one
per client) is refused before it runs, not measured wrong. An open loop's need is a worst case
(``--rate`` x ``--timeout``, reached only by a server that holds every request unanswered until
the client gives up), so it is warned of, not refused (the project's own overload runs, at twice
the saturation rate with a 30 or 60 s timeout, would need tens of thousands); a request that then
finds no descriptor fails as ``0:EMFILE``, and the report's warning says whose failure it was.
"""

from __future__ import annotations

import math
import os
import resource
from typing import Any

SPARE = 32  # beyond what is open now: the /metrics scrape, /proc reads, the event loop's own


def raise_soft_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (never lowers it); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft in (hard, resource.RLIM_INFINITY):
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit, which the kernel may refuse as a soft one
        return soft
    return hard


def open_now() -> int:
    """Descriptors this process holds now (Linux ``/proc/self/fd``); a guess of 16 elsewhere."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def connections_needed(
    concurrency: int, rate: float | None, timeout_s: float, requests: int, pool_cap: int | None = None
) -> int:
    """The most connections the load can hold open at once: one per client in a closed loop; in an
    open loop one per request in flight, which an overloaded server lets grow to ``rate`` x
    ``timeout_s`` before the first times out. Never more than ``requests``, nor ``pool_cap`` (a
    client that queues past its cap, as httpx does)."""
    needed = concurrency if rate is None else math.ceil(rate * timeout_s)
    needed = min(needed, requests)
    return needed if pool_cap is None else min(needed, pool_cap)


def too_many(needed: int, limit: int) -> str | None:
    """Why ``needed`` connections do not fit under the descriptor ``limit``, or None."""
    if limit == resource.RLIM_INFINITY:
        return None
    room = limit - open_now() - SPARE
    if needed <= room:
        return None
    return (
        f"the load may hold {needed} connections open at once, and this process may open {limit} files "
        f"(RLIMIT_NOFILE, raised to its hard limit; {room} left for connections): raise the limit "
        "(`ulimit -n`, or the hard limit it is capped by)"
    )


OUT_OF_DESCRIPTORS = ("0:EMFILE", "0:ENFILE")  # the process's limit, the system's


def out_of_descriptors_line(report: dict[str, Any]) -> str | None:
    """A warning when requests failed in the client for want of a descriptor: the client's failures,
    however they would read beside the server's errors."""
    failed = sum(report.get("errors", {}).get(code, 0) for code in OUT_OF_DESCRIPTORS)
    if not failed:
        return None
    limit = report.get("client_fd_limit")
    return (
        f"warning: {failed} requests failed in the client, which had no file descriptor left"
        + ("" if limit is None else f" (its limit: {limit})")
        + ": the client's failures, not the server's; raise `ulimit -n`, or lower --rate or --timeout"
    )
