"""Batch-size labels and buckets reach the largest batch a lane may be set to."""

from __future__ import annotations

from app.settings import MAX_BATCH
from app.telemetry.metrics import BATCH_BUCKETS, batch_bucket


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
