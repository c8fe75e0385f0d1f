"""The drain's warning when it left requests unanswered, with ``server.shutdown_grace_s`` unset
(None: no limit). No grace can run out then; a drain stopped before it ended (cancelled) leaves
the queued requests answered 503 draining all the same, and the close's drain reported them as
"the drain's grace (no limit) ran out"."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.support import copy_repository, held_batch_and_one_queued


async def test_a_drain_with_no_limit_stopped_early_says_so_not_that_its_grace_ran_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    held = await held_batch_and_one_queued(copy_repository(tmp_path), 30.0)
    service = held.service
    caplog.set_level("INFO", logger="app.service")
    drain = asyncio.create_task(service.drain(None))
    await asyncio.sleep(0.1)
    drain.cancel()  # stopped before it ended (its task cancelled)
    with contextlib.suppress(asyncio.CancelledError):
        await drain
    held.release.set()
    await service.close(None)
    await asyncio.gather(held.running, held.queued, return_exceptions=True)
    said = [r.getMessage() for r in caplog.records if r.name == "app.service" and "drain" in r.getMessage()]
    assert said == [
        "the drain (no time limit) was stopped before it ended: 1 queued or running request(s) answered 503 draining"
    ]
