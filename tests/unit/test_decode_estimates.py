"""The decode stage's share of the predicted wait: the images ahead, the decode time as the last
half second measured it, and the urgent images that overtake a normal one while it waits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.admission import MAX_URGENT_SHARE, DecodeBacklog
from app.batching import Lane
from app.batching.moving import Decaying
from tests.unit.fakes import FakeClock

MS = 0.001


class Seats:
    def release(self, lane: Lane) -> None:
        pass


def backlog(threads: int = 1) -> tuple[DecodeBacklog, FakeClock]:
    clock = FakeClock()
    return DecodeBacklog(threads, clock=clock.now), clock


def decodes(backlog: DecodeBacklog, clock: FakeClock, decode_s: float, seconds: float) -> None:
    """One thread decoding back to back for ``seconds``: every decode takes ``decode_s``."""
    for _ in range(round(seconds / decode_s)):
        clock.t += decode_s
        backlog.record(decode_s)


def test_no_wait_before_a_decode_is_measured_nor_with_nothing_ahead() -> None:
    images, clock = backlog()
    images.seat(Seats(), Lane.NORMAL)
    assert images.wait_s(Lane.NORMAL) == 0.0, "nothing measured yet"
    decodes(images, clock, 4 * MS, 0.1)
    assert images.wait_s(Lane.NORMAL) == pytest.approx(2 * 4 * MS)
    assert images.wait_s(Lane.URGENT) == 0.0, "no urgent image ahead of an urgent one"


def test_the_images_ahead_clear_at_the_threads_pace() -> None:
    images, clock = backlog(threads=2)
    for _ in range(3):
        images.seat(Seats(), Lane.NORMAL)
    images.seat(Seats(), Lane.URGENT)
    clock.t += 60.0  # long ago: no urgent images are arriving now
    decodes(images, clock, 4 * MS, 0.1)
    assert images.wait_s(Lane.NORMAL) == pytest.approx(5 * 4 * MS / 2), "four ahead, then its own"
    assert images.wait_s(Lane.URGENT) == pytest.approx(2 * 4 * MS / 2), "the urgent one ahead only"


def test_the_estimate_is_the_last_half_second_not_the_last_few_decodes() -> None:
    """Admission refuses at the edge of the estimate, so under overload it admits exactly when the
    estimate dips: a few quick decodes must not make the next few hundred look quick."""
    images, clock = backlog()
    images.seat(Seats(), Lane.NORMAL)
    decodes(images, clock, 4 * MS, 1.0)
    decodes(images, clock, 1 * MS, 0.01)  # ten quick ones: the mean of the last ten would say 1 ms
    assert images.wait_s(Lane.NORMAL) / 2 == pytest.approx(4 * MS, rel=0.1)
    decodes(images, clock, 8 * MS, 1.0)  # the host slows: within a second most of the way there
    assert images.wait_s(Lane.NORMAL) / 2 > 7 * MS
    decodes(images, clock, 8 * MS, 1.0)
    assert images.wait_s(Lane.NORMAL) / 2 == pytest.approx(8 * MS, rel=0.03)


def test_urgent_arrivals_lengthen_a_normal_images_wait_not_an_urgent_ones() -> None:
    images, clock = backlog()
    images.seat(Seats(), Lane.NORMAL)
    images.seat(Seats(), Lane.URGENT)
    alone_normal, alone_urgent = 0.0, 0.0
    for step in range(300):  # 3 s: urgent images arrive at 100 a second, each decoded at 4 ms
        clock.t += 10 * MS
        images.record(4 * MS)
        images.seat(Seats(), Lane.URGENT).release()
        if step == 0:
            alone_normal, alone_urgent = images.wait_s(Lane.NORMAL), images.wait_s(Lane.URGENT)
    share = 100 * 4 * MS  # of the one thread's time, the urgent images take 0.4
    assert images.wait_s(Lane.NORMAL) == pytest.approx(3 * 4 * MS / (1 - share), rel=0.03)
    assert images.wait_s(Lane.URGENT) == pytest.approx(2 * 4 * MS), "nothing overtakes an urgent image"
    assert alone_urgent == pytest.approx(2 * 4 * MS) and alone_normal < images.wait_s(Lane.NORMAL)
    clock.t += 5.0  # they stop coming: the normal wait is the images ahead again
    assert images.wait_s(Lane.NORMAL) == pytest.approx(3 * 4 * MS, rel=1e-3)


def test_urgent_images_that_would_take_every_thread_count_as_most_of_them() -> None:
    images, clock = backlog()
    images.seat(Seats(), Lane.NORMAL)
    for _ in range(1000):  # 1000 a second at 4 ms each: four threads' worth
        clock.t += 1 * MS
        images.record(4 * MS)
        images.seat(Seats(), Lane.URGENT).release()
    assert images.wait_s(Lane.NORMAL) == pytest.approx(2 * 4 * MS / (1 - MAX_URGENT_SHARE), rel=1e-6)


@given(
    st.lists(
        st.tuples(st.floats(0, 2.0), st.floats(1e-4, 0.1)),  # (seconds since the last, a decode's seconds)
        min_size=1,
        max_size=50,
    )
)
def test_the_mean_lies_among_the_samples_and_equal_samples_give_their_value(
    samples: list[tuple[float, float]],
) -> None:
    clock = FakeClock()
    mean = Decaying(0.5, clock.now)
    for gap, value in samples:
        clock.t += gap
        mean.add(value)
    values = [value for _, value in samples]
    got = mean.mean()
    assert got is not None and min(values) * (1 - 1e-9) <= got <= max(values) * (1 + 1e-9)
    same = Decaying(0.5, clock.now)
    for gap, _ in samples:
        clock.t += gap
        same.add(values[0])
    assert same.mean() == pytest.approx(values[0])
