"""Hypothesis strategies the batcher's property tests share."""

from __future__ import annotations

from hypothesis import strategies as st

from app.batching import BatchPolicy, LanePolicy, UrgentFill


def batch_policies(
    windows: st.SearchStrategy[float], max_batch: int, max_extra_queue: int, max_backlog: int
) -> st.SearchStrategy[BatchPolicy]:
    """Policies of two lanes, each a window from ``windows``, a max batch up to ``max_batch`` and a
    queue bound of that batch plus up to ``max_extra_queue``; any fill rule."""
    lanes = st.builds(
        lambda window, batch, extra: LanePolicy(window, batch, batch + extra),
        windows,
        st.integers(min_value=1, max_value=max_batch),
        st.integers(min_value=0, max_value=max_extra_queue),
    )
    return st.builds(
        BatchPolicy,
        lanes,
        lanes,
        st.sampled_from(UrgentFill),
        urgent_fill_backlog=st.integers(min_value=1, max_value=max_backlog),
    )
