"""Batch-size labels and buckets reach the largest batch a lane may be set to."""

from __future__ import annotations

from app.settings import MAX_BATCH
from app.telemetry.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, batch_bucket


def test_every_batch_size_a_policy_allows_has_its_own_bounded_label() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 256, 257, 300)] == [
        "1", "2", "3-4", "3-4", "5-8", "9-16", "17-32", "129-256", "257-512", "257-512"
    ]  # fmt: skip
    assert batch_bucket(MAX_BATCH) == f"{MAX_BATCH // 2 + 1}-{MAX_BATCH}"
    labels = {batch_bucket(n) for n in range(1, MAX_BATCH + 1)}
    assert len(labels) == MAX_BATCH.bit_length()  # one per power of two: cardinality stays bounded
    assert not any(label.endswith("+") for label in labels)


def test_the_batch_size_histogram_resolves_batches_up_to_the_largest() -> None:
    assert BATCH_BUCKETS[0] == 1 and BATCH_BUCKETS[-1] == MAX_BATCH
    assert all(b == 2 * a for a, b in zip(BATCH_BUCKETS, BATCH_BUCKETS[1:], strict=False))


def test_latency_buckets_resolve_windows_batches_and_deadlines_within_half_again() -> None:
    """From 5 ms to 1 s each bound is at most 1.5 times the last, so a quantile read off the
    buckets is within that factor: the normal lane's queue wait, just past its 25 ms window, read
    37-50 ms with 25 then 50."""
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    resolved = [b for b in LATENCY_BUCKETS if 0.005 <= b <= 1.0]
    assert resolved[0] == 0.005 and resolved[-1] == 1.0
    assert max(b / a for a, b in zip(resolved, resolved[1:], strict=False)) <= 1.5
    above_window = next(b for b in LATENCY_BUCKETS if b > 0.025)
    assert above_window <= 0.025 * 1.25, "the default normal window's waits share one narrow bucket"
