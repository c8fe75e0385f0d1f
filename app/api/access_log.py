"""The access log: one line per answered request, with 503 answers capped.

Under overload most requests are refused with a 503 (``queue_full``, ``would_miss_deadline``,
``draining``). A line for each is most of the log then, and it costs CPU: at twice the load, the
access log cost 4.5% of the requests answered (docs/performance.md, thirty-third pass). So 503
lines are logged at most ``logging.refusal_lines_per_s`` a second for each code. The rest are
counted by code and summed up in one line (``unlogged_503``, logger ``app.access.unlogged``) once
the first of them is a second old, and when the service closes.
Every answer still counts in the metrics (``ai_backend_requests_total`` by status and code).
Every other status is always logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("app.access")
summary_log = logging.getLogger("app.access.unlogged")

SUMMARY_EVERY_S = 1.0
LOGGED_PATH_CHARS = 1024  # the longest path a log line keeps (as a span attribute: the client's string)


def logged_path(path: str) -> str:
    """A request's path as log lines give it: cut past ``LOGGED_PATH_CHARS`` (a 60 KB path made a
    120 KB access line, written on the event loop)."""
    return path if len(path) <= LOGGED_PATH_CHARS else path[:LOGGED_PATH_CHARS] + "..."


class LineBudget:
    """Lines of several kinds, ``per_s`` a second at most of each: a bucket of one second's worth
    (one line at least) per key, refilled as time passes, so that a flood of one kind hides no
    line of another. What it turns away is counted by key and handed over by ``summary``.
    ``per_s`` 0 lets every line through."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._capacity = max(1.0, per_s)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key: (lines left, when counted)
        self._since = clock()  # when the first line now held was turned away
        self._held: Counter[str] = Counter()

    def take(self, key: str) -> bool:
        """Whether a line of ``key`` may be logged now (if not, it is counted)."""
        if self._per_s <= 0:
            return True
        now = self._clock()
        left, at = self._buckets.get(key, (self._capacity, now))
        left = min(self._capacity, left + (now - at) * self._per_s)
        if left >= 1.0:
            self._buckets[key] = (left - 1.0, now)
            return True
        self._buckets[key] = (left, now)
        if not self._held:
            self._since = now
        self._held[key] += 1
        return False

    def summary(self, force: bool = False) -> tuple[dict[str, int], float] | None:
        """The counts turned away and the seconds since the first of them, and a fresh count;
        None when there are none, or (unless ``force``) the first is under ``SUMMARY_EVERY_S`` old."""
        if not self._held:
            return None
        now = self._clock()
        if not force and now - self._since < SUMMARY_EVERY_S:
            return None
        held = dict(self._held)
        self._held.clear()
        return held, now - self._since


class AccessLog:
    """The access lines of one app: every answer's, 503s within their budget (one per code)."""

    def __init__(self, refusal_lines_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.refusals = LineBudget(refusal_lines_per_s, clock)

    def line(self, method: str, path: str, status: int, code: str, seconds: float, fields: dict[str, Any]) -> None:
        """The line of one request (``code`` is logged for a status of 400 or more, and for status 0:
        nothing was sent, code ``unanswered``)."""
        if status == 503 and not self.refusals.take(code):
            return
        path = logged_path(path)
        log.info(
            "%s %s %d",
            method,
            path,
            status,
            extra={
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": round(seconds * 1000, 3),
                **({"code": code} if not 100 <= status < 400 else {}),
                **fields,
            },
        )

    def report_unlogged(self, force: bool = False) -> None:
        """One line for the 503 answers left unlogged, once the first of them is a second old
        (``force``: now, as the service closes). Not an access line: ``app.access.unlogged``."""
        if (held := self.refusals.summary(force)) is None:
            return
        counts, seconds = held
        total = sum(counts.values())
        fields = {"unlogged_503": total, "by_code": counts}
        summary_log.info("503 answers not logged in the last %.1f s: %d", seconds, total, extra=fields)

    async def report_every(self, seconds: float = SUMMARY_EVERY_S) -> None:
        """``report_unlogged`` every ``seconds``, for as long as the service runs (a lifespan task,
        outside any request: the summary carries no request's id or trace)."""
        while True:
            await asyncio.sleep(seconds)
            self.report_unlogged()
