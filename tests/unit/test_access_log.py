"""The access log's cap on 503 lines (``app.api.access_log``), on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.api.access_log import AccessLog, LineBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_second_s_worth_goes_at_once_then_one_a_refill() -> None:
    clock = Clock()
    budget = LineBudget(3, clock)
    assert [budget.take("queue_full") for _ in range(5)] == [True, True, True, False, False]
    clock.now += 0.34  # a third of a second refills one line
    assert budget.take("queue_full") and not budget.take("queue_full")
    assert budget.summary() is None, "the first line turned away is not a second old"
    clock.now += 1.0
    assert budget.summary() == ({"queue_full": 3}, pytest.approx(1.34))
    assert budget.summary(force=True) is None, "nothing turned away since"


def test_a_flood_of_one_code_hides_no_line_of_another() -> None:
    clock = Clock()
    budget = LineBudget(2, clock)
    assert [budget.take("queue_full") for _ in range(4)] == [True, True, False, False]
    assert budget.take("device_unavailable") and budget.take("not_ready")
    assert budget.summary(force=True) == ({"queue_full": 2}, 0.0)


def test_a_summary_spans_the_lines_it_counts_not_the_quiet_before_them() -> None:
    clock = Clock()
    budget = LineBudget(1, clock)
    clock.now += 300.0  # quiet for five minutes, then a burst
    assert budget.take("queue_full") and not budget.take("queue_full")
    clock.now += 0.5
    assert not budget.take("queue_full") and budget.summary() is None
    clock.now += 0.6
    assert budget.summary() == ({"queue_full": 2}, pytest.approx(1.1))


def test_no_cap_lets_every_line_through_and_a_slow_one_still_one_line() -> None:
    clock = Clock()
    unlimited = LineBudget(0, clock)
    assert all(unlimited.take("queue_full") for _ in range(1000)) and unlimited.summary(force=True) is None
    slow = LineBudget(0.5, clock)  # under one a second: the bucket holds one line, refilled in two seconds
    assert slow.take("a") and not slow.take("a")
    clock.now += 2.0
    assert slow.take("a")


@given(per_s=st.floats(0.5, 50), gaps=st.lists(st.floats(0, 0.2), min_size=1, max_size=300))
def test_no_one_second_window_holds_more_than_the_budget(per_s: float, gaps: list[float]) -> None:
    clock = Clock()
    budget = LineBudget(per_s, clock)
    taken: list[float] = []
    turned_away = 0
    for gap in gaps:
        clock.now += gap
        if budget.take("queue_full"):
            taken.append(clock.now)
        else:
            turned_away += 1
    held = budget.summary(force=True)
    assert len(taken) + (held[0]["queue_full"] if held else 0) == len(gaps) == len(taken) + turned_away
    capacity = max(1.0, per_s)
    for start in taken:  # a window of T seconds holds the bucket's capacity and T's refill at most
        inside = [t for t in taken if start <= t < start + 1.0]
        assert len(inside) <= capacity + per_s + 1e-9


def test_503_lines_are_capped_and_summed_up_while_every_other_status_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    access = AccessLog(2, clock)
    with caplog.at_level(logging.INFO, logger="app.access"):
        for _ in range(5):
            access.line("POST", "/predict", 503, "queue_full", 0.001, {})
        access.line("POST", "/predict", 200, "ok", 0.05, {"lane": "normal"})
        access.line("POST", "/predict", 500, "internal_error", 0.01, {})
        access.report_unlogged()  # the first turned away is not a second old: nothing yet
        clock.now += 1.0
        access.report_unlogged()  # as the service's task does once a second
        access.line("POST", "/predict", 503, "queue_full", 0.001, {})
        access.line("POST", "/predict", 503, "queue_full", 0.001, {})
        access.line("POST", "/predict", 503, "queue_full", 0.001, {})
        access.report_unlogged(force=True)  # as the service closes
    lines = [(r.name, r.getMessage(), getattr(r, "status", None), getattr(r, "code", None)) for r in caplog.records]
    access_line, summary = "app.access", "app.access.unlogged"
    assert lines == [
        (access_line, "POST /predict 503", 503, "queue_full"),
        (access_line, "POST /predict 503", 503, "queue_full"),
        (access_line, "POST /predict 200", 200, None),
        (access_line, "POST /predict 500", 500, "internal_error"),
        (summary, "503 answers not logged in the last 1.0 s: 3", None, None),
        (access_line, "POST /predict 503", 503, "queue_full"),
        (access_line, "POST /predict 503", 503, "queue_full"),
        (summary, "503 answers not logged in the last 0.0 s: 1", None, None),
    ]
    summaries = [r for r in caplog.records if r.name == summary]
    assert [(r.unlogged_503, r.by_code) for r in summaries] == [(3, {"queue_full": 3}), (1, {"queue_full": 1})]


async def test_the_summary_comes_from_its_own_task(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    access = AccessLog(1, clock)
    reporting = asyncio.create_task(access.report_every(0.01))
    try:
        with caplog.at_level(logging.INFO, logger="app.access"):
            for _ in range(3):
                access.line("POST", "/predict", 503, "draining", 0.001, {})
            clock.now += 1.0  # the first turned away is a second old: the task's next turn sums them up
            async with asyncio.timeout(10):  # a bound on a broken task, not a timing
                while not any(hasattr(r, "unlogged_503") for r in caplog.records):  # noqa: ASYNC110 (no event)
                    await asyncio.sleep(0.01)
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting
    (summary,) = [r for r in caplog.records if hasattr(r, "unlogged_503")]
    assert summary.unlogged_503 == 2 and summary.by_code == {"draining": 2}
