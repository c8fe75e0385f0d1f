"""The service driving admission, the decode pool, the batcher and the runner, on the real loop:
random lanes and deadlines, callers that go at any point, policy changes, out-of-memory on the
device, and a drain in the middle. Every prediction ends once, as an answer, a 503 (or the
caller's own cancel), never a 500; and when all have ended no seat is held and nothing is queued.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from app.batching import Lane
from app.errors import ServiceError
from app.prediction import Outcome
from app.service import InferenceService
from app.settings import BatchingSettings, Settings
from app.versions import ServedModel
from tests.faults import Faulty

ROOT = Path(__file__).resolve().parents[2]
IMAGE = (ROOT / "models" / "digits" / "samples" / "digit_7.png").read_bytes()


def _policy(rng: random.Random) -> BatchingSettings:
    def lane(window_ms: float) -> dict[str, float | int]:
        batch = rng.randint(1, 8)
        return {"window_ms": window_ms, "max_batch": batch, "max_queue": batch + rng.randint(0, 16)}

    return BatchingSettings.model_validate(
        {"urgent": lane(rng.choice([1.0, 2.0])), "normal": lane(rng.choice([2.0, 25.0]))}
    )


async def _predict(service: InferenceService, served: ServedModel, lane: Lane, timeout_s: float) -> Outcome:
    return await service.predict(served, IMAGE, 1, lane, timeout_s)


async def _play(seed: int, requests: int, fail_at: int | None, drain_at: int | None, grace_s: float) -> None:
    rng = random.Random(seed)
    service = InferenceService(Settings(model={"repository": ROOT / "models", "warmup": False}))  # type: ignore[arg-type]
    await service.start()
    served = service.served(None)
    if fail_at is not None:  # the device runs out of memory at this batch size
        served.runner.model = Faulty(served.runner.model, fail_at=fail_at)  # type: ignore[arg-type]
    tasks: list[asyncio.Task[Outcome]] = []
    cancelled: set[int] = set()
    drained: asyncio.Task[None] | None = None
    try:
        for i in range(requests):
            if i == drain_at:
                drained = asyncio.ensure_future(service.drain(grace_s))
            if service.ready:
                lane = rng.choice(list(Lane))
                timeout = rng.choice([0.001, 0.004, 0.02, 1.0])
                tasks.append(asyncio.ensure_future(_predict(service, served, lane, timeout)))
            roll = rng.random()
            if roll < 0.4:
                await asyncio.sleep(rng.choice([0, 0.0005, 0.003]))
            elif roll < 0.45:
                service.set_policy(_policy(rng))
            if tasks and rng.random() < 0.2:
                victim = rng.randrange(len(tasks))
                if not tasks[victim].done():
                    cancelled.add(victim)
                    tasks[victim].cancel()
        async with asyncio.timeout(20):
            ended = await asyncio.gather(*tasks, return_exceptions=True)
        for i, result in enumerate(ended):
            if isinstance(result, asyncio.CancelledError):
                assert i in cancelled, "cancelled, though its caller did not go"
            elif isinstance(result, ServiceError):
                assert result.status == 503, f"{result.code} ({result.status}): {result}"
            else:
                assert isinstance(result, Outcome), repr(result)
                assert result.predictions and result.predictions[0].label == "7"
        for lane in Lane:
            assert served.batcher.depth(lane) == 0, f"{lane}: a seat or a request left behind"
        assert service._backlog.wait_s(Lane.NORMAL) == 0.0, "the decode backlog counts a request that ended"
    finally:
        if drained is not None:
            await drained
        await service.close(1.0)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**32),
    st.integers(min_value=1, max_value=80),
    st.one_of(st.none(), st.integers(min_value=2, max_value=6)),
    st.one_of(st.none(), st.integers(min_value=0, max_value=80)),
    st.sampled_from([0.0, 0.005, 1.0]),
)
def test_every_prediction_ends_once_and_leaves_no_seat_behind(
    seed: int, requests: int, fail_at: int | None, drain_at: int | None, grace_s: float
) -> None:
    asyncio.run(_play(seed, requests, fail_at, drain_at, grace_s))
