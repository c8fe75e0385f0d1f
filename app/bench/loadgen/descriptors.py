"""The client's own file descriptors: one per connection in flight, within the process's limit.

Many shells start with a soft ``RLIMIT_NOFILE`` of 1024. Past it every new connection fails in
the client (``EMFILE``), and those failures read as the server's errors. So the soft limit is
raised to the hard one at start, and a load that could still need more connections than that is
refused before it runs, not measured wrong.
"""

from __future__ import annotations

import math
import os
import resource

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
        "(`ulimit -n`, or the hard limit it is capped by), or lower --concurrency (open loop: --rate or --timeout)"
    )
